//! The Vulkan backend (feature `vulkan`): being written.
