//! What model calls use: [`Usage`], the token counts, requests and cost of
//! one call or of many summed, and [`Usd`], money as an exact amount.
//!
//! Counts are summed with saturating arithmetic and money is a whole
//! number of nano-dollars, so a total kept for the life of a session never
//! drifts the way a running sum of floating-point prices would.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// An amount of US dollars, exact to the nano-dollar (10⁻⁹ $).
///
/// Written and read as a decimal string of dollars (`"0.0125"`), so a
/// stored total reads back to the nano-dollar and says its unit.
///
/// ```
/// use markov_core::usage::Usd;
///
/// let limit: Usd = "0.50".parse().unwrap();
/// assert_eq!(limit, Usd::from_cents(50));
/// assert_eq!(Usd::from_micros(1_250).to_string(), "$0.00125");
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Usd(u64);

impl Usd {
    /// Nothing.
    pub const ZERO: Usd = Usd(0);

    /// `nanos` nano-dollars (10⁻⁹ $).
    pub const fn from_nanos(nanos: u64) -> Self {
        Usd(nanos)
    }

    /// `micros` micro-dollars (10⁻⁶ $), saturating.
    pub const fn from_micros(micros: u64) -> Self {
        Usd(micros.saturating_mul(1_000))
    }

    /// `cents` cents, saturating.
    pub const fn from_cents(cents: u64) -> Self {
        Usd(cents.saturating_mul(10_000_000))
    }

    /// The amount in nano-dollars.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// The sum, saturating at the largest amount.
    #[must_use]
    pub const fn saturating_add(self, other: Usd) -> Usd {
        Usd(self.0.saturating_add(other.0))
    }

    /// Whether the amount is zero.
    pub const fn is_zero(self) -> bool {
        self.0 == 0
    }

    /// The decimal text of the amount in dollars, without a sign: at least
    /// two decimals, no trailing zeros beyond them.
    fn decimal(self) -> String {
        // The nine digits of the fraction by hand: every cost and total a
        // server writes (its steps, their events, their records) passes
        // here, and the formatter took two passes and two strings.
        let mut fraction = self.0 % 1_000_000_000;
        let mut digits = [b'0'; 9];
        for digit in digits.iter_mut().rev() {
            *digit = b"0123456789"[usize::try_from(fraction % 10).unwrap_or(0)];
            fraction /= 10;
        }
        let shown = digits
            .iter()
            .rposition(|&d| d != b'0')
            .map_or(2, |last| (last + 1).max(2));
        let mut out = (self.0 / 1_000_000_000).to_string();
        out.push('.');
        out.extend(digits[..shown].iter().copied().map(char::from));
        out
    }
}

impl std::ops::Add for Usd {
    type Output = Usd;

    fn add(self, other: Usd) -> Usd {
        self.saturating_add(other)
    }
}

impl std::ops::AddAssign for Usd {
    fn add_assign(&mut self, other: Usd) {
        *self = self.saturating_add(other);
    }
}

impl fmt::Display for Usd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "${}", self.decimal())
    }
}

/// Why a text is not an amount of dollars.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{text:?} is not an amount of dollars: write digits with at most nine decimals, like \"0.50\""
)]
#[non_exhaustive]
pub struct ParseUsdError {
    /// The text given.
    pub text: String,
}

impl FromStr for Usd {
    type Err = ParseUsdError;

    /// Reads `"1"`, `"0.50"`, `"$0.000125"`: digits with at most nine
    /// decimals, an optional leading `$`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let refuse = || ParseUsdError {
            text: text.to_owned(),
        };
        let digits = text.trim().strip_prefix('$').unwrap_or(text.trim());
        let (whole, fraction) = digits.split_once('.').unwrap_or((digits, ""));
        let all_digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
        if whole.is_empty() || !all_digits(whole) || !all_digits(fraction) || fraction.len() > 9 {
            return Err(refuse());
        }
        let whole: u64 = whole.parse().map_err(|_| refuse())?;
        let fraction: u64 = if fraction.is_empty() {
            0
        } else {
            format!("{fraction:0<9}").parse().map_err(|_| refuse())?
        };
        whole
            .checked_mul(1_000_000_000)
            .and_then(|n| n.checked_add(fraction))
            .map(Usd)
            .ok_or_else(refuse)
    }
}

impl Serialize for Usd {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.decimal())
    }
}

impl<'de> Deserialize<'de> for Usd {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn no_cost(cost: &Usd) -> bool {
    cost.is_zero()
}

/// Token counts, requests and cost: of one model call, or summed over a
/// step, a turn, a run or a session.
///
/// A provider fills in the token counts of its answer; the executor counts
/// the request and prices it. `input_tokens` leaves out the cached tokens,
/// which have counts of their own; `output_tokens` includes the reasoning
/// tokens, which `reasoning_tokens` counts again on their own.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Usage {
    /// Input tokens, cached ones left out.
    pub input_tokens: u64,
    /// Output tokens, reasoning included.
    pub output_tokens: u64,
    /// Input tokens read from the prompt cache.
    pub cache_read_input_tokens: u64,
    /// Input tokens written to the prompt cache.
    pub cache_creation_input_tokens: u64,
    /// Of the output tokens, those the model spent reasoning (OpenAI's
    /// `reasoning_tokens`, Gemini's `thoughtsTokenCount`; Anthropic does
    /// not report them apart).
    #[serde(skip_serializing_if = "is_zero")]
    pub reasoning_tokens: u64,
    /// Model calls made.
    #[serde(skip_serializing_if = "is_zero")]
    pub requests: u64,
    /// What the priced calls cost (see `unpriced_requests`).
    #[serde(skip_serializing_if = "no_cost")]
    pub cost: Usd,
    /// Calls whose model had no known price: their cost is not in `cost`.
    #[serde(skip_serializing_if = "is_zero")]
    pub unpriced_requests: u64,
}

impl Usage {
    /// Every token counted: input, cached input (read and written) and
    /// output.
    pub fn total_tokens(&self) -> u64 {
        self.input_tokens
            .saturating_add(self.output_tokens)
            .saturating_add(self.cache_read_input_tokens)
            .saturating_add(self.cache_creation_input_tokens)
    }

    /// Whether nothing was used.
    pub fn is_empty(&self) -> bool {
        *self == Usage::default()
    }
}

impl std::ops::AddAssign for Usage {
    fn add_assign(&mut self, rhs: Usage) {
        self.input_tokens = self.input_tokens.saturating_add(rhs.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(rhs.output_tokens);
        self.cache_read_input_tokens = self
            .cache_read_input_tokens
            .saturating_add(rhs.cache_read_input_tokens);
        self.cache_creation_input_tokens = self
            .cache_creation_input_tokens
            .saturating_add(rhs.cache_creation_input_tokens);
        self.reasoning_tokens = self.reasoning_tokens.saturating_add(rhs.reasoning_tokens);
        self.requests = self.requests.saturating_add(rhs.requests);
        self.cost += rhs.cost;
        self.unpriced_requests = self.unpriced_requests.saturating_add(rhs.unpriced_requests);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dollars_read_and_write_exactly() {
        for (text, nanos, shown) in [
            ("0.50", 500_000_000, "$0.50"),
            ("$1", 1_000_000_000, "$1.00"),
            ("0.000000001", 1, "$0.000000001"),
            ("12.3456", 12_345_600_000, "$12.3456"),
            ("0", 0, "$0.00"),
            ("0.1", 100_000_000, "$0.10"),
            ("7.000000010", 7_000_000_010, "$7.00000001"),
            ("18446744073.709551615", u64::MAX, "$18446744073.709551615"),
        ] {
            let usd: Usd = text.parse().unwrap();
            assert_eq!(usd.as_nanos(), nanos);
            assert_eq!(usd.to_string(), shown);
            let json = serde_json::to_string(&usd).unwrap();
            assert_eq!(serde_json::from_str::<Usd>(&json).unwrap(), usd);
        }
    }

    #[test]
    fn text_that_is_not_dollars_is_refused() {
        for text in [
            "",
            ".5",
            "-1",
            "1.0000000001",
            "1e3",
            "abc",
            "18446744073709551615",
        ] {
            assert!(text.parse::<Usd>().is_err(), "{text:?} was read");
        }
    }

    #[test]
    fn sums_saturate_instead_of_wrapping() {
        let mut usage = Usage {
            input_tokens: u64::MAX,
            cost: Usd::from_nanos(u64::MAX),
            ..Usage::default()
        };
        usage += Usage {
            input_tokens: 1,
            requests: 1,
            cost: Usd::from_nanos(1),
            ..Usage::default()
        };
        assert_eq!(usage.input_tokens, u64::MAX);
        assert_eq!(usage.cost.as_nanos(), u64::MAX);
        assert_eq!(usage.requests, 1);
    }

    #[test]
    fn old_counts_without_the_new_fields_read_back() {
        let usage: Usage = serde_json::from_str(
            r#"{"input_tokens":3,"output_tokens":4,"cache_read_input_tokens":0,"cache_creation_input_tokens":0}"#,
        )
        .unwrap();
        assert_eq!(usage.total_tokens(), 7);
        assert_eq!(usage.requests, 0);
        // And counts without requests or cost write as before.
        assert_eq!(
            serde_json::to_string(&usage).unwrap(),
            r#"{"input_tokens":3,"output_tokens":4,"cache_read_input_tokens":0,"cache_creation_input_tokens":0}"#
        );
    }
}
