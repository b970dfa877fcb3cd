//! The system prompt (spec §10).
