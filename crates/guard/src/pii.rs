//! PII redaction with a reversible mapping.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;

use crate::{Guard, Hold, Verdict};

/// What kind of personal data a span is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Email,
    Phone,
    Card,
    Secret,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Email => "EMAIL",
            Kind::Phone => "PHONE",
            Kind::Card => "CARD",
            Kind::Secret => "SECRET",
        }
    }
}

/// The mapping of placeholders to the values they stand for, shared by a
/// redactor and its restorers.
#[derive(Debug, Default)]
struct Vault {
    by_value: HashMap<String, String>,
    by_placeholder: HashMap<String, String>,
    counts: HashMap<&'static str, u32>,
}

impl Vault {
    fn placeholder(&mut self, kind: Kind, value: &str) -> String {
        if let Some(p) = self.by_value.get(value) {
            return p.clone();
        }
        let n = self.counts.entry(kind.label()).or_insert(0);
        *n += 1;
        let placeholder = format!("[{}_{}]", kind.label(), n);
        self.by_value.insert(value.to_owned(), placeholder.clone());
        self.by_placeholder
            .insert(placeholder.clone(), value.to_owned());
        placeholder
    }
}

/// Redacts emails, phone numbers, card numbers (those whose Luhn checksum
/// holds) and keys and tokens recognised by their prefix (`sk-`, `ghp_`,
/// `AKIA`, `xoxb-`, `Bearer …`), each replaced by a placeholder such as
/// `[EMAIL_1]`; one value keeps one placeholder. Clones share the mapping,
/// and [`Self::restorer`] turns placeholders back into the values where a
/// tool needs the real one. Holds streamed text per sentence.
#[derive(Debug, Clone, Default)]
pub struct PiiRedactor {
    vault: Arc<Mutex<Vault>>,
}

impl PiiRedactor {
    /// A redactor with an empty mapping.
    pub fn new() -> Self {
        Self::default()
    }

    /// `text` with every recognised value replaced by its placeholder.
    pub fn redact(&self, text: &str) -> String {
        let spans = find(text);
        if spans.is_empty() {
            return text.to_owned();
        }
        let mut vault = self.vault.lock().unwrap_or_else(PoisonError::into_inner);
        let mut out = String::with_capacity(text.len());
        let mut at = 0;
        for (start, end, kind) in spans {
            out.push_str(&text[at..start]);
            out.push_str(&vault.placeholder(kind, &text[start..end]));
            at = end;
        }
        out.push_str(&text[at..]);
        out
    }

    /// `text` with the placeholders this redactor made replaced by their
    /// values.
    pub fn restore(&self, text: &str) -> String {
        let vault = self.vault.lock().unwrap_or_else(PoisonError::into_inner);
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        while let Some(open) = rest.find('[') {
            out.push_str(&rest[..open]);
            let tail = &rest[open..];
            match tail.find(']').map(|close| &tail[..=close]) {
                Some(candidate) if vault.by_placeholder.contains_key(candidate) => {
                    out.push_str(&vault.by_placeholder[candidate]);
                    rest = &tail[candidate.len()..];
                }
                _ => {
                    out.push('[');
                    rest = &tail[1..];
                }
            }
        }
        out.push_str(rest);
        out
    }

    /// A guard that restores this redactor's placeholders: placed on tool
    /// calls, a tool gets the real value the model only saw redacted.
    pub fn restorer(&self) -> PiiRestorer {
        PiiRestorer {
            redactor: self.clone(),
        }
    }
}

#[async_trait]
impl Guard for PiiRedactor {
    fn name(&self) -> &str {
        "pii"
    }

    fn hold(&self) -> Hold {
        Hold::Sentence
    }

    async fn check(&self, text: &str) -> Verdict {
        let redacted = self.redact(text);
        if redacted == text {
            Verdict::Pass
        } else {
            Verdict::Rewrite(redacted)
        }
    }
}

/// Turns a [`PiiRedactor`]'s placeholders back into their values (see
/// [`PiiRedactor::restorer`]).
#[derive(Debug, Clone)]
pub struct PiiRestorer {
    redactor: PiiRedactor,
}

#[async_trait]
impl Guard for PiiRestorer {
    fn name(&self) -> &str {
        "pii-restore"
    }

    async fn check(&self, text: &str) -> Verdict {
        let restored = self.redactor.restore(text);
        if restored == text {
            Verdict::Pass
        } else {
            Verdict::Rewrite(restored)
        }
    }
}

/// The spans of personal data in `text`, in order and not overlapping.
fn find(text: &str) -> Vec<(usize, usize, Kind)> {
    let bytes = text.as_bytes();
    let mut spans = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let at_word_start = i == 0 || !is_word(bytes[i - 1]);
        let secret = if at_word_start {
            secret_at(text, i).map(|e| (e, Kind::Secret))
        } else {
            None
        };
        let found = secret.or_else(|| email_at(bytes, i).map(|(_, e)| (e, Kind::Email)));
        let number = if found.is_none() && at_word_start {
            number_at(bytes, i)
        } else {
            None
        };
        match (found, number) {
            (Some((end, kind)), _) | (None, Some((end, Some(kind)))) => {
                spans.push((i, end, kind));
                i = end;
            }
            // A number that is no phone or card is skipped whole: no
            // part of it is one either.
            (None, Some((end, None))) => i = end.max(i + 1),
            (None, None) => i += 1,
        }
    }
    spans
}

fn is_word(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

fn is_local(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'%' | b'+' | b'-')
}

/// An email whose local part starts at `i`: its start and end.
fn email_at(bytes: &[u8], i: usize) -> Option<(usize, usize)> {
    if !bytes[i].is_ascii_alphanumeric() || (i > 0 && is_local(bytes[i - 1])) {
        return None;
    }
    let mut j = i;
    while j < bytes.len() && is_local(bytes[j]) {
        j += 1;
    }
    if bytes.get(j) != Some(&b'@') {
        return None;
    }
    let domain = j + 1;
    let mut k = domain;
    while k < bytes.len() && (bytes[k].is_ascii_alphanumeric() || matches!(bytes[k], b'.' | b'-')) {
        k += 1;
    }
    // A trailing dot ends the sentence, not the domain.
    while k > domain && bytes[k - 1] == b'.' {
        k -= 1;
    }
    let host = &bytes[domain..k];
    let dot = host.iter().rposition(|&b| b == b'.')?;
    let tld = &host[dot + 1..];
    (dot > 0 && tld.len() >= 2 && tld.iter().all(u8::is_ascii_alphabetic)).then_some((i, k))
}

/// A phone or card number starting at `i`: digits with single spaces,
/// dashes, dots or parentheses between them, a leading `+` allowed. Its
/// end, and its kind when it is one.
fn number_at(bytes: &[u8], i: usize) -> Option<(usize, Option<Kind>)> {
    let first = bytes[i];
    if !(first.is_ascii_digit() || first == b'+' || first == b'(') {
        return None;
    }
    let mut digits = String::new();
    let mut j = i;
    let mut end = i;
    while j < bytes.len() {
        let b = bytes[j];
        if b.is_ascii_digit() {
            digits.push(char::from(b));
            j += 1;
            end = j;
        } else if (b == b'+' && j == i)
            || matches!(b, b'(' | b')')
            || (matches!(b, b' ' | b'-' | b'.')
                && bytes
                    .get(j + 1)
                    .is_some_and(|n| n.is_ascii_digit() || *n == b'('))
        {
            j += 1;
        } else {
            break;
        }
    }
    if bytes.get(end).is_some_and(|b| is_word(*b)) {
        return Some((end, None));
    }
    let n = digits.len();
    if (13..=19).contains(&n) && luhn(&digits) {
        return Some((end, Some(Kind::Card)));
    }
    // A phone number has a separator or a `+`: a bare run of digits is
    // more often an amount or an id.
    let formatted = bytes[i..end].iter().any(|b| !b.is_ascii_digit());
    Some((
        end,
        (formatted && (7..=15).contains(&n)).then_some(Kind::Phone),
    ))
}

/// The Luhn checksum of a card number.
fn luhn(digits: &str) -> bool {
    let mut sum = 0;
    for (k, d) in digits.bytes().rev().enumerate() {
        let mut v = u32::from(d - b'0');
        if k % 2 == 1 {
            v *= 2;
            if v > 9 {
                v -= 9;
            }
        }
        sum += v;
    }
    sum % 10 == 0
}

/// Prefixes of keys and tokens, and how many token bytes must follow.
const SECRET_PREFIXES: &[(&str, usize)] = &[
    ("sk-", 16),
    ("sk_live_", 16),
    ("sk_test_", 16),
    ("pk_live_", 16),
    ("ghp_", 20),
    ("gho_", 20),
    ("github_pat_", 20),
    ("xoxb-", 10),
    ("xoxp-", 10),
    ("AKIA", 16),
    ("AIza", 30),
    ("Bearer ", 16),
];

fn is_token(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b'~' | b'+' | b'/' | b'=')
}

/// A key or token starting at `i`: its end.
fn secret_at(text: &str, i: usize) -> Option<usize> {
    let rest = &text.as_bytes()[i..];
    SECRET_PREFIXES.iter().find_map(|(prefix, min)| {
        if !rest.starts_with(prefix.as_bytes()) {
            return None;
        }
        let body = rest[prefix.len()..]
            .iter()
            .take_while(|b| is_token(**b))
            .count();
        (body >= *min).then_some(i + prefix.len() + body)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emails_phones_cards_and_keys_are_redacted() {
        let pii = PiiRedactor::new();
        let text = "Mail ann.lee+x@mail.example.org or call +1 (555) 010-4477. \
                    Card 4111 1111 1111 1111, key sk-abcdefghijklmnop1234 done.";
        assert_eq!(
            pii.redact(text),
            "Mail [EMAIL_1] or call [PHONE_1]. Card [CARD_1], key [SECRET_1] done."
        );
    }

    #[test]
    fn a_card_number_with_a_bad_checksum_is_no_card() {
        let pii = PiiRedactor::new();
        // Off by one in the last digit: no card, and too long for a phone.
        assert_eq!(pii.redact("4111 1111 1111 1112"), "4111 1111 1111 1112");
        assert_eq!(
            pii.redact("order 12345678 shipped"),
            "order 12345678 shipped"
        );
        assert_eq!(pii.redact("pi is 3.14159."), "pi is 3.14159.");
    }

    #[test]
    fn one_value_keeps_one_placeholder_and_restores() {
        let pii = PiiRedactor::new();
        let a = pii.redact("a@b.io and c@d.io and a@b.io");
        assert_eq!(a, "[EMAIL_1] and [EMAIL_2] and [EMAIL_1]");
        assert_eq!(pii.restore(&a), "a@b.io and c@d.io and a@b.io");
        assert_eq!(pii.restore("[EMAIL_9] [x"), "[EMAIL_9] [x");
    }

    #[tokio::test]
    async fn the_restorer_gives_tools_the_real_value() {
        let pii = PiiRedactor::new();
        let shown = pii.redact("write to ann@example.com");
        let restorer = pii.restorer();
        let args = format!(r#"{{"to":"{}"}}"#, &shown["write to ".len()..]);
        assert_eq!(
            restorer.check(&args).await,
            Verdict::Rewrite(r#"{"to":"ann@example.com"}"#.into())
        );
        assert_eq!(restorer.check("{}").await, Verdict::Pass);
    }
}
