//! The facade's integration tests, one binary: the examples' eval
//! datasets, run offline.

mod evals;
