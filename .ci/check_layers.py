#!/usr/bin/env python3
"""The layering rule of ARCHITECTURE.md: no import cycle among tickline's top-level modules (`src/<module>`).

A module depends on another when its code (not its comments or its unit tests) names `crate::<module>`, or a
crate-root item that `src/lib.rs` re-exports from it. Prints the dependency graph; exits 1 on a cycle.
"""
import os
import re
import sys

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def module_of(name):
    return os.path.exists(os.path.join(SRC, name + ".rs")) or os.path.isdir(os.path.join(SRC, name))


def root_reexports():
    """Crate-root names -> the top-level module they come from."""
    lib = open(os.path.join(SRC, "lib.rs")).read()
    found = {}
    for module, body in re.findall(r"pub use ([a-z_]+)(?:::[a-z_]+)*::\{([^}]*)\}", lib, re.S):
        for name, alias in re.findall(r"([A-Za-z_0-9]+)(?:\s+as\s+([A-Za-z_0-9]+))?", body):
            found[alias or name] = module
    for module, name in re.findall(r"pub use ([a-z_]+)(?:::[a-z_]+)*::([A-Za-z_0-9]+);", lib):
        found[name] = module
    return found


def code_of(path):
    text = open(path).read()
    cut = text.find("#[cfg(test)]\nmod tests")
    if cut >= 0:
        text = text[:cut]
    return "\n".join(line for line in text.split("\n") if not line.strip().startswith("//"))


def dependencies():
    roots = root_reexports()
    deps = {}
    for directory, _, files in os.walk(SRC):
        for file in files:
            if not file.endswith(".rs") or file in ("tests.rs", "loom_tests.rs"):
                continue
            path = os.path.join(directory, file)
            top = os.path.relpath(path, SRC).split(os.sep)[0].removesuffix(".rs")
            if top == "lib":
                continue
            code = code_of(path)
            named = set(re.findall(r"crate::([a-z_]+)", code))
            for group in re.findall(r"use crate::\{([^;]*)\};", code, re.S):
                named |= set(re.findall(r"(?:^|[,{\s])([a-z_]+)(?=::|\s*[,}]|$)", group))
            named |= {roots[n] for n in re.findall(r"crate::([A-Z][A-Za-z_0-9]*)", code) if n in roots}
            deps.setdefault(top, set()).update(m for m in named if m != top and module_of(m))
    return deps


def cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main():
    graph = dependencies()
    for module in sorted(graph):
        print(f"{module:12} -> {', '.join(sorted(graph[module])) or '-'}")
    found = cycles(graph)
    for component in found:
        print(f"import cycle among: {', '.join(component)}", file=sys.stderr)
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
