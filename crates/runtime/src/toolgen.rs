//! Tool generation: the tool list a model sees (spec §11).
