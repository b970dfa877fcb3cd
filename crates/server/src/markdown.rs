//! Markdown written by a model, as HTML the page can show: pulldown-cmark
//! renders it, ammonia keeps only the markup markdown itself makes.
//!
//! Nothing the model writes becomes markup of its own: raw HTML in the
//! markdown is turned into text before rendering (shown, escaped, not
//! dropped), and the sanitizer then removes whatever is not a plain
//! formatting tag — a second wall, should the renderer ever let something
//! through. Links keep only `http`, `https` and `mailto` targets and open
//! in a new tab without a referrer; images become links to their source
//! (the page loads nothing from elsewhere). Characters that change how
//! the text around them reads without being seen — controls,
//! bidirectional overrides, zero-width spaces — are written as visible,
//! marked code points.

use std::collections::{HashMap, HashSet};
use std::sync::LazyLock;

use markov_core::{Message, Role};
use pulldown_cmark::{CodeBlockKind, CowStr, Event, Options, Parser, Tag, TagEnd};
use serde_json::Value;

/// Past this many bytes a text is not rendered: the page shows it as plain
/// text (a model's megabyte of output should not cost the server a
/// megabyte of sanitizing per view, nor the page a megabyte of markup).
pub(crate) const MAX_RENDERED_BYTES: usize = 256 * 1024;

/// The sanitizer: the tags markdown makes, a link's target, a list's
/// start, and the class that marks a hidden character.
static CLEANER: LazyLock<ammonia::Builder<'static>> = LazyLock::new(|| {
    let mut builder = ammonia::Builder::empty();
    builder
        .tags(HashSet::from([
            "p",
            "br",
            "hr",
            "h1",
            "h2",
            "h3",
            "h4",
            "h5",
            "h6",
            "strong",
            "em",
            "del",
            "code",
            "pre",
            "blockquote",
            "ul",
            "ol",
            "li",
            "a",
            "table",
            "thead",
            "tbody",
            "tr",
            "th",
            "td",
            "span",
        ]))
        // Dropped with everything inside them, should one get this far.
        .clean_content_tags(HashSet::from(["script", "style"]))
        .tag_attributes(HashMap::from([
            ("a", HashSet::from(["href"])),
            ("ol", HashSet::from(["start"])),
            ("span", HashSet::from(["title"])),
        ]))
        .allowed_classes(HashMap::from([("span", HashSet::from(["escaped"]))]))
        .url_schemes(HashSet::from(["http", "https", "mailto"]))
        .url_relative(ammonia::UrlRelative::Deny)
        .link_rel(Some("noopener noreferrer nofollow"))
        .set_tag_attribute_value("a", "target", "_blank")
        .strip_comments(true);
    builder
});

/// `text` (markdown) as sanitized HTML, or `None` when it is too long to
/// render (see [`MAX_RENDERED_BYTES`]).
pub(crate) fn to_html(text: &str) -> Option<String> {
    if text.len() > MAX_RENDERED_BYTES {
        return None;
    }
    let options = Options::ENABLE_TABLES | Options::ENABLE_STRIKETHROUGH;
    // Whether each open link is kept: a link to anywhere but the web or
    // an address is its text alone (the sanitizer would leave an `a`
    // that goes nowhere).
    let mut links: Vec<bool> = Vec::new();
    let events = Parser::new_ext(text, options).flat_map(move |event| {
        let events: Vec<Event<'_>> = match event {
            // The model's HTML is text: a block of it is shown as code, an
            // inline tag as the characters it is made of.
            Event::Start(Tag::HtmlBlock) => {
                vec![Event::Start(Tag::CodeBlock(CodeBlockKind::Indented))]
            }
            Event::End(TagEnd::HtmlBlock) => vec![Event::End(TagEnd::CodeBlock)],
            Event::Html(html) | Event::InlineHtml(html) => visible(html),
            Event::Text(text) => visible(text),
            Event::Code(code) if code.chars().any(is_hidden) => {
                let mut events = vec![Event::InlineHtml("<code>".into())];
                events.extend(visible(code));
                events.push(Event::InlineHtml("</code>".into()));
                events
            }
            // An image is a link to its source: the page loads nothing
            // from elsewhere.
            Event::Start(
                Tag::Link {
                    link_type,
                    dest_url,
                    title,
                    id,
                }
                | Tag::Image {
                    link_type,
                    dest_url,
                    title,
                    id,
                },
            ) => {
                let kept = is_web_or_mail(&dest_url);
                links.push(kept);
                if kept {
                    vec![Event::Start(Tag::Link {
                        link_type,
                        dest_url,
                        title,
                        id,
                    })]
                } else {
                    Vec::new()
                }
            }
            Event::End(TagEnd::Link | TagEnd::Image) => {
                if links.pop().unwrap_or(false) {
                    vec![Event::End(TagEnd::Link)]
                } else {
                    Vec::new()
                }
            }
            other => vec![other],
        };
        events
    });
    let mut html = String::with_capacity(text.len() + text.len() / 4);
    pulldown_cmark::html::push_html(&mut html, events);
    Some(CLEANER.clean(&html).to_string())
}

/// Whether a link may go to `url`: `http`, `https` and `mailto` only (what
/// the sanitizer keeps too).
fn is_web_or_mail(url: &str) -> bool {
    let url = url.trim_start().to_ascii_lowercase();
    ["http://", "https://", "mailto:"]
        .iter()
        .any(|scheme| url.starts_with(scheme))
}

/// `messages` as JSON, as the API writes them, each assistant text also
/// rendered: a text item gets `html`, and so does a message whose `items`
/// is a plain string. A text too long to render has none (the page shows
/// it as plain text). The assistant messages' thinking is left out unless
/// `thinking`: the agent says whether the thinking its history keeps may
/// be shown (the history keeps it as the provider signed it; output
/// guards check only what is streamed).
pub(crate) fn shown(messages: &[Message], thinking: bool) -> Value {
    let mut out = Vec::with_capacity(messages.len());
    for message in messages {
        let mut value = serde_json::to_value(message).unwrap_or(Value::Null);
        if message.role == Role::Assistant {
            if !thinking && let Some(Value::Array(items)) = value.get_mut("items") {
                items.retain(|item| item.get("type").and_then(Value::as_str) != Some("thinking"));
            }
            add_html(&mut value);
        }
        out.push(value);
    }
    Value::Array(out)
}

/// The HTML [`shown`] already rendered for `text` in `shown_messages`: an
/// assistant text item (or message) whose text is `text`, from the last.
/// A step's answer is the text of its last message, so the step's event
/// renders it once; `to_html` is a function of the text alone, so what was
/// rendered for the item is what rendering the answer would give.
pub(crate) fn rendered(shown_messages: &Value, text: &str) -> Option<String> {
    let html_of = |object: &serde_json::Map<String, Value>, text_key: &str| {
        (object.get(text_key).and_then(Value::as_str) == Some(text))
            .then(|| {
                object
                    .get("html")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            })
            .flatten()
    };
    shown_messages.as_array()?.iter().rev().find_map(|message| {
        let message = message.as_object()?;
        match message.get("items")? {
            Value::String(_) => html_of(message, "items"),
            Value::Array(items) => items
                .iter()
                .rev()
                .filter_map(Value::as_object)
                .filter(|item| item.get("type").and_then(Value::as_str) == Some("text"))
                .find_map(|item| html_of(item, "text")),
            _ => None,
        }
    })
}

fn add_html(message: &mut Value) {
    let Some(object) = message.as_object_mut() else {
        return;
    };
    let rendered = match object.get_mut("items") {
        Some(Value::String(text)) => to_html(text),
        Some(Value::Array(items)) => {
            for item in items.iter_mut().filter_map(Value::as_object_mut) {
                if item.get("type").and_then(Value::as_str) != Some("text") {
                    continue;
                }
                if let Some(html) = item.get("text").and_then(Value::as_str).and_then(to_html) {
                    item.insert("html".into(), Value::String(html));
                }
            }
            None
        }
        _ => None,
    };
    if let Some(html) = rendered {
        object.insert("html".into(), Value::String(html));
    }
}

/// Whether `c` changes how the text around it is shown without being seen
/// itself: a control (but new lines and tabs), a format character (the
/// bidirectional overrides and isolates, zero-width spaces, the byte order
/// mark, ...), a line or paragraph separator. The zero-width joiner and
/// non-joiner are left alone in prose: they build emoji and join the
/// letters of Persian or Indic words, and reorder nothing.
pub(crate) fn is_hidden(c: char) -> bool {
    if c == '\n' || c == '\t' {
        return false;
    }
    if c.is_control() {
        return true;
    }
    matches!(
        u32::from(c),
        0x00AD
            | 0x0600..=0x0605
            | 0x061C
            | 0x06DD
            | 0x070F
            | 0x0890..=0x0891
            | 0x08E2
            | 0x180E
            | 0x200B
            | 0x200E..=0x200F
            | 0x2028..=0x202E
            | 0x2060..=0x2064
            | 0x2066..=0x206F
            | 0xFEFF
            | 0xFFF9..=0xFFFB
            | 0x110BD
            | 0x110CD
            | 0x13430..=0x1343F
            | 0x1BCA0..=0x1BCA3
            | 0x1D173..=0x1D17A
            | 0xE0001
            | 0xE0020..=0xE007F
    )
}

/// `text` as text events, each hidden character replaced by a marked,
/// visible `\u{…}` (markup the sanitizer keeps: a `span` of class
/// `escaped` whose title names the code point).
fn visible(text: CowStr<'_>) -> Vec<Event<'_>> {
    if !text.chars().any(is_hidden) {
        return vec![Event::Text(text)];
    }
    let mut events = Vec::new();
    let mut plain = String::new();
    for c in text.chars() {
        if is_hidden(c) {
            if !plain.is_empty() {
                events.push(Event::Text(std::mem::take(&mut plain).into()));
            }
            let code = u32::from(c);
            events.push(Event::InlineHtml(
                format!("<span class=\"escaped\" title=\"U+{code:04X}\">\\u{{{code:04X}}}</span>")
                    .into(),
            ));
        } else {
            plain.push(c);
        }
    }
    if !plain.is_empty() {
        events.push(Event::Text(plain.into()));
    }
    events
}

#[cfg(test)]
mod tests {
    use super::*;

    fn html(text: &str) -> String {
        to_html(text).expect("rendered")
    }

    #[test]
    fn markdown_becomes_its_markup() {
        assert_eq!(
            html("**bold** and `code`\n\n- one\n- two"),
            "<p><strong>bold</strong> and <code>code</code></p>\n<ul>\n<li>one</li>\n<li>two</li>\n</ul>\n"
        );
        let fenced = html("```rust\nfn main() { a < b }\n```");
        assert_eq!(fenced, "<pre><code>fn main() { a &lt; b }\n</code></pre>\n");
        let table = html("| a | b |\n|:--|--:|\n| 1 | 2 |");
        assert!(
            table.contains("<table>") && table.contains("<td>1</td>"),
            "{table}"
        );
        assert!(!table.contains("style"), "{table}");
    }

    #[test]
    fn the_models_html_is_shown_as_text_never_as_markup() {
        let inline = html("hello <b onclick=\"x()\">there</b> <script>alert(1)</script>");
        assert!(!inline.contains("<b"), "{inline}");
        assert!(!inline.contains("<script"), "{inline}");
        assert!(
            inline.contains("&lt;b onclick=\"x()\"&gt;there&lt;/b&gt;")
                || inline.contains("&lt;b onclick=&quot;x()&quot;&gt;there&lt;/b&gt;"),
            "the tag is shown, escaped: {inline}"
        );
        assert!(
            inline.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
            "{inline}"
        );
        let block = html("<div>\n<img src=x onerror=alert(1)>\n</div>\n\nafter");
        assert!(block.starts_with("<pre><code>&lt;div&gt;"), "{block}");
        assert!(
            !block.contains("<img") && !block.contains("<div"),
            "{block}"
        );
        assert!(block.contains("<p>after</p>"), "{block}");
        let comment = html("a <!-- hidden --> b");
        assert!(comment.contains("&lt;!-- hidden --&gt;"), "{comment}");
    }

    #[test]
    fn links_keep_only_web_and_mail_targets() {
        let safe = html("[site](https://example.com/a?b=1) [mail](mailto:a@example.com)");
        assert!(
            safe.contains("<a href=\"https://example.com/a?b=1\" target=\"_blank\" rel=\"noopener noreferrer nofollow\">site</a>"),
            "{safe}"
        );
        assert!(safe.contains("href=\"mailto:a@example.com\""), "{safe}");
        for hostile in [
            "[x](javascript:alert(1))",
            "[x](JaVaScRiPt:alert(1))",
            "[x](data:text/html,<script>alert(1)</script>)",
            "[x](vbscript:msgbox)",
            "[x](/relative/path)",
            "<javascript:alert(1)>",
            "[x](java\u{0}script:alert(1))",
        ] {
            let shown = html(hostile);
            assert!(!shown.contains("<a"), "{hostile}: {shown}");
            assert!(
                !shown.to_lowercase().contains("<script"),
                "{hostile}: {shown}"
            );
        }
        let image = html("![a cat](https://example.com/cat.png) ![x](javascript:alert(1))");
        assert!(!image.contains("<img"), "{image}");
        assert!(
            image.ends_with(" x</p>\n"),
            "the other is its text: {image}"
        );
        assert!(
            image.contains("<a href=\"https://example.com/cat.png\"")
                && image.contains(">a cat</a>"),
            "an image is a link to its source: {image}"
        );
    }

    #[test]
    fn hidden_characters_are_written_visibly() {
        let shown = html("invoice \u{202E}fdp.exe and `x\u{200B}y`");
        assert!(
            !shown.contains('\u{202E}') && !shown.contains('\u{200B}'),
            "{shown}"
        );
        assert!(
            shown.contains(
                "invoice <span class=\"escaped\" title=\"U+202E\">\\u{202E}</span>fdp.exe"
            ),
            "{shown}"
        );
        assert!(
            shown.contains(
                "<code>x<span class=\"escaped\" title=\"U+200B\">\\u{200B}</span>y</code>"
            ),
            "{shown}"
        );
        // Emoji sequences keep their joiners.
        assert!(html("👩\u{200D}💻").contains('\u{200D}'));
    }

    #[test]
    fn the_sanitizer_keeps_only_what_markdown_makes() {
        // Markup that reached the sanitizer however it did.
        let cleaned = CLEANER
            .clean(
                "<span class=\"x escaped\" onclick=\"y()\">a</span><a href=\"javascript:x\">b</a>\
                 <img src=\"https://example.com/x.png\"><script>alert(1)</script><p style=\"color:red\">c</p>",
            )
            .to_string();
        assert_eq!(
            cleaned,
            "<span class=\"escaped\">a</span><a target=\"_blank\" rel=\"noopener noreferrer nofollow\">b</a><p>c</p>"
        );
    }

    #[test]
    fn assistant_texts_get_their_html_and_nothing_else_does() {
        let messages = vec![
            Message::user("**not rendered**"),
            Message::assistant_items(vec![
                markov_core::Item::text("**yes**"),
                markov_core::Item::tool_use("c1", "pay", serde_json::json!({"memo": "**no**"})),
            ]),
            serde_json::from_value(
                serde_json::json!({"role": "assistant", "items": "*plain string*"}),
            )
            .expect("a message of a plain string"),
        ];
        let view = shown(&messages, true);
        assert_eq!(view[0].get("html"), None);
        assert_eq!(view[0]["items"][0].get("html"), None);
        assert_eq!(view[1]["items"][0]["html"], "<p><strong>yes</strong></p>\n");
        assert_eq!(view[1]["items"][0]["text"], "**yes**", "the raw text stays");
        assert_eq!(view[1]["items"][1].get("html"), None);
        assert_eq!(view[2]["html"], "<p><em>plain string</em></p>\n");
    }

    #[test]
    fn an_answer_rendered_among_the_messages_is_found_as_rendering_it_would_give() {
        let messages = vec![
            Message::user("**asked**"),
            Message::assistant_items(vec![
                markov_core::Item::text("*first*"),
                markov_core::Item::text("**the answer**"),
            ]),
            serde_json::from_value(serde_json::json!({"role": "assistant", "items": "`plain`"}))
                .expect("a message of a plain string"),
        ];
        let view = shown(&messages, true);
        for text in ["**the answer**", "*first*", "`plain`"] {
            assert_eq!(rendered(&view, text), to_html(text), "{text}");
        }
        // Neither the user's words nor a text no message holds.
        assert_eq!(rendered(&view, "**asked**"), None);
        assert_eq!(rendered(&view, "**the answer** and more"), None);
        assert_eq!(rendered(&Value::Null, "x"), None);
    }

    #[test]
    fn a_text_too_long_is_not_rendered() {
        assert!(to_html(&"a".repeat(MAX_RENDERED_BYTES + 1)).is_none());
        assert!(to_html(&"a".repeat(MAX_RENDERED_BYTES)).is_some());
    }
}
