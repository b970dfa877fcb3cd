//! [`PostgresStore`]: sessions in PostgreSQL, for several worker processes.

/// Sessions in PostgreSQL (being written).
#[derive(Debug)]
pub struct PostgresStore;
