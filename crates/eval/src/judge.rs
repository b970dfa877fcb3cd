//! The LLM judge: any [`Model`] reads the conversation and a rubric and
//! answers `PASS` or `FAIL` with a reason.

use markov_core::model::{Model, ModelRequest, ModelSettings, ToolChoice};
use markov_core::{Item, Message, Role};

use crate::expect::{CaseRun, Verdict};

/// The judge's instructions; the rubric and the transcript follow in the
/// user message.
pub const JUDGE_INSTRUCTIONS: &str = "You grade an AI agent's conversation against a rubric. \
Read the rubric and the transcript, then answer with one line: `PASS: <reason>` if the \
agent's final answer satisfies the rubric, else `FAIL: <reason>`.";

/// The transcript the judge reads: each message's role, text, tool calls
/// and tool results, one per line.
pub fn transcript(history: &[Message]) -> String {
    let mut out = String::new();
    for message in history {
        let role = match message.role {
            Role::User => "user",
            Role::Assistant => "assistant",
            _ => continue,
        };
        for item in message.item_list() {
            match item {
                Item::Text { text } => out.push_str(&format!("{role}: {text}\n")),
                Item::ToolUse { name, input, .. } => {
                    out.push_str(&format!("{role} calls {name}({input})\n"));
                }
                Item::ToolResult {
                    content,
                    is_error,
                    images,
                    ..
                } => {
                    let kind = if *is_error == Some(true) {
                        "error"
                    } else {
                        "result"
                    };
                    out.push_str(&format!("tool {kind}: {content}\n"));
                    // A judge reads text: an image is its note.
                    for image in images {
                        out.push_str(&format!("tool image: {}\n", image.note()));
                    }
                }
                _ => {}
            }
        }
    }
    out
}

/// Reads a verdict line: the first word `PASS` or `FAIL` (any case,
/// surrounding punctuation ignored), the rest its reason.
pub fn parse_verdict(answer: &str) -> Option<(bool, String)> {
    let answer = answer.trim();
    let word: String = answer
        .trim_start_matches(|c: char| !c.is_alphanumeric())
        .chars()
        .take_while(|c| c.is_alphanumeric())
        .collect();
    let passed = match word.to_ascii_uppercase().as_str() {
        "PASS" => true,
        "FAIL" => false,
        _ => return None,
    };
    let reason = answer
        .trim_start_matches(|c: char| !c.is_alphanumeric())
        .get(word.len()..)
        .unwrap_or_default()
        .trim_start_matches(|c: char| !c.is_alphanumeric())
        .trim()
        .to_owned();
    Some((passed, reason))
}

/// Asks `model` to grade `run` against `rubric`. An answer that is neither
/// `PASS` nor `FAIL`, or a failed call, is a failed verdict that says so;
/// the judge's usage is in the verdict, apart from the agent's.
pub async fn judge(model: &dyn Model, rubric: &str, run: &CaseRun) -> Verdict {
    let prompt = format!(
        "Rubric:\n{rubric}\n\nTranscript:\n{}\nYour verdict (PASS or FAIL, then the reason):",
        transcript(&run.history)
    );
    let messages = [Message::user(prompt)];
    let settings = ModelSettings::default();
    let request = ModelRequest::new(JUDGE_INSTRUCTIONS, &messages, &settings)
        .with_tool_choice(&ToolChoice::None);
    let response = match model.complete(request).await {
        Ok(response) => response,
        Err(e) => return Verdict::fail(format!("the judge failed: {e}")),
    };
    let text: String = response
        .content
        .iter()
        .filter_map(|item| match item {
            Item::Text { text } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    let mut verdict = match parse_verdict(&text) {
        Some((true, reason)) => Verdict {
            detail: reason,
            ..Verdict::pass()
        },
        Some((false, reason)) => Verdict::fail(reason).at_step(run.steps.len()),
        None => Verdict::fail(format!(
            "the judge answered neither PASS nor FAIL: {text:?}"
        )),
    };
    let mut usage = response.usage;
    usage.requests = usage.requests.max(1);
    verdict.usage = usage;
    verdict
}

#[cfg(test)]
mod tests {
    use super::parse_verdict;

    #[test]
    fn verdicts_read_leniently_and_nothing_else_passes() {
        assert_eq!(
            parse_verdict("PASS: right sum"),
            Some((true, "right sum".into()))
        );
        assert_eq!(
            parse_verdict("**Fail** - wrong"),
            Some((false, "wrong".into()))
        );
        assert_eq!(parse_verdict("pass"), Some((true, String::new())));
        assert_eq!(parse_verdict("I think it passes"), None);
        assert_eq!(parse_verdict("PASSED"), None);
    }
}
