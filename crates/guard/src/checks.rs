//! Two small guards, as examples of writing one's own.

use async_trait::async_trait;

use crate::{Guard, Hold, Verdict};

/// Blocks a text longer than a number of characters. It needs the whole
/// answer at once.
#[derive(Debug, Clone)]
pub struct MaxLength {
    chars: usize,
}

impl MaxLength {
    /// Blocks texts of more than `chars` characters.
    pub fn new(chars: usize) -> Self {
        MaxLength { chars }
    }
}

#[async_trait]
impl Guard for MaxLength {
    fn name(&self) -> &str {
        "max-length"
    }

    async fn check(&self, text: &str) -> Verdict {
        let n = text.chars().count();
        if n > self.chars {
            Verdict::block(format!(
                "the text has {n} characters, more than the {} allowed",
                self.chars
            ))
        } else {
            Verdict::Pass
        }
    }
}

/// Blocks a text not written in one script, such as an answer that must
/// be in a language written in Latin letters: fewer than 80 % of its
/// letters in the script's ranges is a block. Text without letters
/// passes. Checks streamed text per sentence.
#[derive(Debug, Clone)]
pub struct Script {
    name: String,
    ranges: Vec<(char, char)>,
}

impl Script {
    /// A script named `name` made of the letters in `ranges` (inclusive).
    pub fn new(name: impl Into<String>, ranges: impl IntoIterator<Item = (char, char)>) -> Self {
        Script {
            name: name.into(),
            ranges: ranges.into_iter().collect(),
        }
    }

    /// Latin letters (ASCII and the Latin-1, Extended-A and Extended-B
    /// blocks).
    pub fn latin() -> Self {
        Self::new("Latin", [('A', 'Z'), ('a', 'z'), ('\u{C0}', '\u{24F}')])
    }

    /// Cyrillic letters.
    pub fn cyrillic() -> Self {
        Self::new("Cyrillic", [('\u{400}', '\u{4FF}')])
    }
}

#[async_trait]
impl Guard for Script {
    fn name(&self) -> &str {
        "script"
    }

    fn hold(&self) -> Hold {
        Hold::Sentence
    }

    async fn check(&self, text: &str) -> Verdict {
        let (mut letters, mut inside) = (0usize, 0usize);
        for c in text.chars().filter(|c| c.is_alphabetic()) {
            letters += 1;
            if self.ranges.iter().any(|(lo, hi)| (*lo..=*hi).contains(&c)) {
                inside += 1;
            }
        }
        if letters == 0 || inside * 5 >= letters * 4 {
            Verdict::Pass
        } else {
            Verdict::block(format!("the text is not written in {} letters", self.name))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn length_blocks_past_the_limit_only() {
        let g = MaxLength::new(5);
        assert_eq!(g.check("héllo").await, Verdict::Pass);
        assert!(matches!(g.check("hello!").await, Verdict::Block { .. }));
    }

    #[tokio::test]
    async fn script_blocks_another_alphabet() {
        let g = Script::latin();
        assert_eq!(g.check("Grüße, café! 42").await, Verdict::Pass);
        assert_eq!(g.check("1234 …").await, Verdict::Pass);
        assert_eq!(
            g.check("Привет, как дела?").await,
            Verdict::block("the text is not written in Latin letters")
        );
        assert_eq!(Script::cyrillic().check("Привет").await, Verdict::Pass);
    }
}
