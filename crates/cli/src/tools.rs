//! The demo's two tools: `add` and `population`.

use std::convert::Infallible;

use markov_core::async_trait;
use markov_core::tool::{Tool, ToolContext};
use schemars::JsonSchema;
use serde::Deserialize;

/// Adds two integers.
#[derive(Debug, Clone, Copy)]
pub struct Add;

/// The input of `add`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct AddArgs {
    /// The first addend.
    a: i64,
    /// The second addend.
    b: i64,
}

#[async_trait]
impl Tool for Add {
    const NAME: &'static str = "add";
    type Args = AddArgs;
    type Output = i64;
    type Error = Infallible;
    fn description(&self) -> String {
        "Add two integers.".into()
    }
    async fn call(&self, args: AddArgs, _cx: &ToolContext<'_>) -> Result<i64, Infallible> {
        Ok(args.a + args.b)
    }
}

/// Looks up a city's population in a small table.
#[derive(Debug, Clone, Copy)]
pub struct Population;

/// The input of `population`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct PopulationArgs {
    /// The city.
    city: String,
}

/// The table has no entry for the city.
#[derive(Debug, thiserror::Error)]
#[error("no population known for {0}")]
pub struct UnknownCity(String);

#[async_trait]
impl Tool for Population {
    const NAME: &'static str = "population";
    type Args = PopulationArgs;
    type Output = i64;
    type Error = UnknownCity;
    fn description(&self) -> String {
        "Population of a city (Lisbon, Porto).".into()
    }
    async fn call(&self, args: PopulationArgs, _cx: &ToolContext<'_>) -> Result<i64, UnknownCity> {
        match args.city.as_str() {
            "Lisbon" => Ok(545_923),
            "Porto" => Ok(231_962),
            _ => Err(UnknownCity(args.city)),
        }
    }
}
