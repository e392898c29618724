//! tickline's benches live in this crate's bench targets (`cargo bench -p tickline-benches --bench NAME`);
//! the library is empty. See `README.md` beside it for what each bench measures and the latest medians.
