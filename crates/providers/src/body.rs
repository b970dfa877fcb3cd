//! Request bodies built from encoded messages kept between calls.
//!
//! A model call sends the whole conversation, so a client that encodes every
//! message on every call spends time in proportion to the history on each
//! step. A machine's history is only ever appended to, and its requests say
//! so with a [`HistoryId`]: the client keeps, per history, the JSON of the
//! wire messages that can no longer change and encodes only what is new.
//! Building a body is then a copy of those bytes plus the few new messages.
//!
//! Each vendor renders a run of history messages into wire messages
//! ([`Rendered`]); the last wire message may still grow when the next
//! history message has the same role (Anthropic merges them), so it is kept
//! out of the cache until a later message closes it. A vendor whose wire
//! messages never merge closes all of them at once.
//!
//! The parts of a request around its messages (model, system prompt, tool
//! schemas, settings) are the same on most calls of a client; a
//! [`FrameCache`] keeps the last few encoded, each with a copy of everything
//! it was built from, and uses one only when the request equals that copy.
//!
//! The bytes are the exact bytes `serde_json::to_vec` of the whole request
//! writes: the head and tail of the request object are serialized as two
//! objects and joined around the messages array. In test and debug builds
//! every cached body is checked against the body encoded afresh
//! ([`check_cached`]), so every test of the workspace checks the promise
//! the cache rests on.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use markov_core::model::{HistoryId, ModelSettings, ToolChoice};
use markov_core::tool::{ProviderTool, ToolDefinition, ToolName};
use markov_core::{Message, ModelError, ModelRequest};
use serde::Serialize;
use serde_json::Value;

/// How many bytes of encoded messages a client keeps by default, over all
/// the histories it serves.
pub const DEFAULT_BODY_CACHE_BYTES: usize = 64 * 1024 * 1024;

/// The wire messages of a run of history messages, as one vendor renders
/// them.
pub(crate) struct Rendered {
    /// The JSON of the wire messages that are final, each followed by a comma.
    pub closed: Vec<u8>,
    /// How many wire messages `closed` holds.
    pub closed_count: usize,
    /// How many history messages (from the start of the run) the final wire
    /// messages cover: the next run starts there.
    pub consumed: usize,
    /// The JSON of the wire message that may still grow, if any (no comma).
    pub open: Option<Vec<u8>>,
}

/// The final wire messages of one history, encoded.
#[derive(Default)]
struct Encoded {
    /// History messages covered.
    covered: usize,
    /// Their wire messages, each followed by a comma.
    json: Vec<u8>,
    /// How many wire messages `json` holds.
    count: usize,
    /// When the entry was last used (for eviction).
    used: u64,
}

impl Encoded {
    /// What the entry counts against the cache's limit.
    fn size(&self) -> usize {
        self.json.len()
    }
}

/// A request's parts around its messages, encoded.
pub(crate) struct FrameBytes {
    /// The fields before `messages`, as an object (never empty).
    head: Vec<u8>,
    /// Wire messages that come before the history's (a system message),
    /// each followed by a comma.
    lead: Vec<u8>,
    /// How many wire messages `lead` holds.
    lead_count: usize,
    /// The fields after `messages`, as an object (may be `{}`).
    tail: Vec<u8>,
    /// The name of the array of wire messages (`messages`, or `input` in
    /// OpenAI's Responses API).
    array: &'static str,
}

impl FrameBytes {
    /// Encodes `head` and `tail` (structs of the fields before and after
    /// `messages`) around `lead_count` wire messages `lead`, each followed
    /// by a comma.
    pub(crate) fn new<H: Serialize, T: Serialize>(
        head: &H,
        lead: Vec<u8>,
        lead_count: usize,
        tail: &T,
    ) -> Result<Self, ModelError> {
        Ok(FrameBytes {
            head: to_json(head)?,
            lead,
            lead_count,
            tail: to_json(tail)?,
            array: "messages",
        })
    }

    /// The same parts around an array named `array` instead of `messages`.
    #[cfg(feature = "responses")]
    pub(crate) fn named(mut self, array: &'static str) -> Self {
        self.array = array;
        self
    }
}

impl AsRef<FrameBytes> for FrameBytes {
    fn as_ref(&self) -> &FrameBytes {
        self
    }
}

/// How many frames a [`FrameCache`] keeps.
const FRAMES: usize = 4;

/// Everything of a request a frame is built from: all of it but its
/// messages, the model it goes to and what the body is for (`P`, the
/// vendor's purpose). Owned copies, compared field by field.
struct FrameKey<P> {
    purpose: P,
    model: String,
    system: String,
    tools: Vec<ToolDefinition>,
    provider_tools: Vec<ProviderTool>,
    tool_choice: ToolChoice,
    settings: ModelSettings,
    output_schema: Option<Value>,
    deferred_tools: Vec<ToolName>,
}

impl<P: PartialEq + Copy> FrameKey<P> {
    fn of(request: &ModelRequest<'_>, model: &str, purpose: P) -> Self {
        FrameKey {
            purpose,
            model: model.to_owned(),
            system: request.system().to_owned(),
            tools: request.tools().to_vec(),
            provider_tools: request.provider_tools().to_vec(),
            tool_choice: request.tool_choice().clone(),
            settings: request.settings().clone(),
            output_schema: request.output_schema().cloned(),
            deferred_tools: request.deferred_tools().to_vec(),
        }
    }

    /// Whether `request` (to `model`, for `purpose`) has exactly these
    /// parts.
    fn matches(&self, request: &ModelRequest<'_>, model: &str, purpose: P) -> bool {
        self.purpose == purpose
            && self.model == model
            && self.system == request.system()
            && self.tool_choice == *request.tool_choice()
            && self.settings == *request.settings()
            && self.deferred_tools == request.deferred_tools()
            && self.output_schema.as_ref() == request.output_schema()
            && self.provider_tools == request.provider_tools()
            && self.tools == request.tools()
    }
}

/// The last few frames a client encoded, each kept with a copy of what it
/// was built from ([`FrameKey`]: the request but its messages, the model,
/// the purpose) and used again only for a request equal to that copy; the
/// vendor's own settings are the client's and never change. Shared by a
/// client's clones.
pub(crate) struct FrameCache<P>(Arc<Mutex<Vec<KeptFrame<P>>>>);

/// A kept frame and what it was built from.
type KeptFrame<P> = (FrameKey<P>, Arc<FrameBytes>);

impl<P> Clone for FrameCache<P> {
    fn clone(&self) -> Self {
        FrameCache(Arc::clone(&self.0))
    }
}

impl<P> Default for FrameCache<P> {
    fn default() -> Self {
        FrameCache(Arc::new(Mutex::new(Vec::with_capacity(FRAMES))))
    }
}

impl<P: PartialEq + Copy> FrameCache<P> {
    /// The frame of `request` to `model` for `purpose`: the one kept for
    /// equal parts, else `build`'s, kept in place of the least recently
    /// used. A frame `build` refuses is not kept.
    pub(crate) fn get_or_build(
        &self,
        request: &ModelRequest<'_>,
        model: &str,
        purpose: P,
        build: impl FnOnce() -> Result<FrameBytes, ModelError>,
    ) -> Result<Arc<FrameBytes>, ModelError> {
        {
            let mut frames = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(at) = frames
                .iter()
                .position(|(key, _)| key.matches(request, model, purpose))
            {
                // Most recently used last.
                let hit = frames.remove(at);
                let frame = Arc::clone(&hit.1);
                frames.push(hit);
                return Ok(frame);
            }
        }
        let frame = Arc::new(build()?);
        let mut frames = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if frames.len() >= FRAMES {
            frames.remove(0);
        }
        frames.push((FrameKey::of(request, model, purpose), Arc::clone(&frame)));
        Ok(frame)
    }
}

/// Encoded histories by id, bounded in bytes; shared by a client's clones.
#[derive(Clone)]
pub(crate) struct BodyCache(Arc<Mutex<Entries>>);

struct Entries {
    by_history: HashMap<HistoryId, Encoded>,
    bytes: usize,
    limit: usize,
    clock: u64,
}

impl std::fmt::Debug for BodyCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let entries = self.lock();
        f.debug_struct("BodyCache")
            .field("histories", &entries.by_history.len())
            .field("bytes", &entries.bytes)
            .field("limit", &entries.limit)
            .finish()
    }
}

impl BodyCache {
    /// A cache that keeps at most `limit` bytes (0 keeps nothing).
    pub(crate) fn new(limit: usize) -> Self {
        BodyCache(Arc::new(Mutex::new(Entries {
            by_history: HashMap::new(),
            bytes: 0,
            limit,
            clock: 0,
        })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        // The map stays consistent between statements; a panic elsewhere
        // cannot leave it half-updated.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the entry of `id` out, so the copy happens outside the lock (a
    /// concurrent request of the same history encodes afresh).
    fn take(&self, id: HistoryId) -> Option<Encoded> {
        let mut entries = self.lock();
        let entry = entries.by_history.remove(&id)?;
        entries.bytes -= entry.size();
        Some(entry)
    }

    fn put(&self, id: HistoryId, mut entry: Encoded) {
        let mut entries = self.lock();
        if entry.size() > entries.limit {
            return;
        }
        entries.clock += 1;
        entry.used = entries.clock;
        entries.bytes += entry.size();
        if let Some(old) = entries.by_history.insert(id, entry) {
            entries.bytes -= old.size();
        }
        while entries.bytes > entries.limit {
            // The least recently used history goes first; `id` was just used,
            // so it goes last.
            let Some(oldest) = entries
                .by_history
                .iter()
                .min_by_key(|(_, e)| e.used)
                .map(|(id, _)| *id)
            else {
                break;
            };
            if let Some(gone) = entries.by_history.remove(&oldest) {
                entries.bytes -= gone.size();
            }
        }
    }
}

/// Builds the body of `request`: the head, then `"messages":[...]` with
/// the history's wire messages, then the tail. With `cache` and a history
/// id, the final wire messages are taken from (and added to) the cache;
/// without, everything is encoded.
///
/// `frame()` encodes the parts around the messages (and checks them). `render(run)`
/// renders a run of history messages that starts at a wire message
/// boundary. Fails when no wire message results (`empty` is the message),
/// `frame` fails or a part does not serialize.
pub(crate) fn build<F: AsRef<FrameBytes>>(
    request: &ModelRequest<'_>,
    cache: Option<&BodyCache>,
    frame: impl FnOnce() -> Result<F, ModelError>,
    render: impl Fn(&[Message]) -> Result<Rendered, ModelError>,
    empty: &str,
) -> Result<Vec<u8>, ModelError> {
    let history = request.messages();
    let cached = cache.zip(request.history_id());
    let mut entry = match cached {
        Some((cache, id)) => cache
            .take(id)
            // A history shorter than what was encoded broke the promise of
            // its id: start over rather than send stale messages.
            .filter(|e| e.covered <= history.len())
            .unwrap_or_default(),
        None => Encoded::default(),
    };
    let frame = frame()?;
    let frame = frame.as_ref();
    let rendered = render(&history[entry.covered..])?;
    entry.json.extend_from_slice(&rendered.closed);
    entry.count += rendered.closed_count;
    entry.covered += rendered.consumed;
    let count = frame.lead_count + entry.count + usize::from(rendered.open.is_some());
    if count == 0 {
        return Err(ModelError::InvalidRequest(empty.to_owned()));
    }

    let (head, tail) = (&frame.head, &frame.tail);
    let open = rendered.open.as_deref().unwrap_or_default();
    let mut body = Vec::with_capacity(
        head.len() + frame.lead.len() + entry.json.len() + open.len() + tail.len() + 16,
    );
    // `{"model":...}` without its closing brace.
    body.extend_from_slice(&head[..head.len().saturating_sub(1)]);
    body.extend_from_slice(b",\"");
    body.extend_from_slice(frame.array.as_bytes());
    body.extend_from_slice(b"\":[");
    body.extend_from_slice(&frame.lead);
    body.extend_from_slice(&entry.json);
    if open.is_empty() {
        // The last message's comma goes: JSON has no trailing commas.
        if body.last() == Some(&b',') {
            body.pop();
        }
    } else {
        body.extend_from_slice(open);
    }
    body.push(b']');
    if tail.len() > 2 {
        // `{"tools":...}` joins as `,"tools":...}`.
        body.push(b',');
        body.extend_from_slice(&tail[1..]);
    } else {
        body.push(b'}');
    }
    if let Some((cache, id)) = cached {
        cache.put(id, entry);
    }
    Ok(body)
}

fn to_json<S: Serialize>(value: &S) -> Result<Vec<u8>, ModelError> {
    serde_json::to_vec(value)
        .map_err(|e| ModelError::InvalidRequest(format!("cannot encode the request: {e}")))
}

/// Appends `value`'s JSON and a comma.
pub(crate) fn push_json<S: Serialize>(out: &mut Vec<u8>, value: &S) -> Result<(), ModelError> {
    write_json(out, value)?;
    out.push(b',');
    Ok(())
}

/// `messages` written by `write` one after another, each followed by a
/// comma (the form of [`Rendered::closed`]).
pub(crate) fn write_each<M>(
    messages: &[M],
    write: impl Fn(&M, &mut Vec<u8>) -> Result<(), ModelError>,
) -> Result<Vec<u8>, ModelError> {
    // About what a short message takes, so the buffer rarely grows.
    let mut out = Vec::with_capacity(256 * messages.len());
    for message in messages {
        write(message, &mut out)?;
        out.push(b',');
    }
    Ok(out)
}

/// Appends `value`'s JSON, as serde_json writes it.
pub(crate) fn write_json<S: Serialize + ?Sized>(
    out: &mut Vec<u8>,
    value: &S,
) -> Result<(), ModelError> {
    serde_json::to_writer(&mut *out, value)
        .map_err(|e| ModelError::InvalidRequest(format!("cannot encode the request: {e}")))
}

/// Checks a body built from the cache against the body of the same request
/// encoded afresh: `Err` names the first byte where they part.
#[cfg(any(debug_assertions, test))]
pub(crate) fn check_cached(cached: &[u8], fresh: &[u8]) -> Result<(), String> {
    if cached == fresh {
        return Ok(());
    }
    let at = cached
        .iter()
        .zip(fresh)
        .position(|(a, b)| a != b)
        .unwrap_or(cached.len().min(fresh.len()));
    Err(format!(
        "a request body built from the cache differs from the body encoded afresh at byte {at} ({} vs {} bytes): the history of its id was not append-only",
        cached.len(),
        fresh.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eviction_keeps_the_byte_limit_and_drops_the_least_recently_used() {
        let cache = BodyCache::new(10);
        let entry = |n: usize| Encoded {
            covered: 1,
            json: vec![b'x'; n],
            count: 1,
            used: 0,
        };
        let (a, b, c) = (HistoryId::fresh(), HistoryId::fresh(), HistoryId::fresh());
        cache.put(a, entry(4));
        cache.put(b, entry(4));
        // Using `a` again makes `b` the oldest.
        let taken = cache.take(a).expect("a is cached");
        cache.put(a, taken);
        cache.put(c, entry(4));
        assert!(
            cache.take(b).is_none(),
            "the least recently used entry goes"
        );
        assert!(cache.take(a).is_some() && cache.take(c).is_some());
        assert_eq!(cache.lock().bytes, 0);
        // An entry larger than the whole cache is not kept.
        cache.put(a, entry(11));
        assert!(cache.take(a).is_none());
    }

    /// A frame whose every input is named: `{"n":<builds so far>}`, so a
    /// test tells a kept frame from a new one.
    fn counted(builds: &std::cell::Cell<usize>) -> Result<FrameBytes, ModelError> {
        builds.set(builds.get() + 1);
        FrameBytes::new(
            &serde_json::json!({ "n": builds.get() }),
            Vec::new(),
            0,
            &serde_json::json!({}),
        )
    }

    #[test]
    fn a_frame_is_kept_for_equal_parts_and_built_again_when_any_part_differs() {
        let frames = FrameCache::<u8>::default();
        let builds = std::cell::Cell::new(0);
        let settings = ModelSettings::default();
        let tool = |description: &str| {
            ToolDefinition::new("add", description, serde_json::json!({"type": "object"}))
                .expect("a tool")
        };
        let tools = [tool("adds")];
        let other_tools = [tool("adds two numbers")];
        let request = ModelRequest::new("be brief", &[], &settings).with_tools(&tools);
        let get = |request: &ModelRequest<'_>, model: &str, purpose: u8| {
            frames
                .get_or_build(request, model, purpose, || counted(&builds))
                .expect("a frame")
        };
        let first = get(&request, "m", 0);
        assert!(Arc::ptr_eq(&first, &get(&request, "m", 0)));
        assert_eq!(builds.get(), 1);
        // Each part the frame is built from, changed alone.
        let other_system = request.with_system("be thorough");
        let other_tools = request.with_tools(&other_tools);
        let hotter = ModelSettings {
            temperature: Some(0.5),
            ..ModelSettings::default()
        };
        let other_settings = request.with_settings(&hotter);
        let schema = serde_json::json!({"type": "object"});
        let with_schema = request.with_output_schema(Some(&schema));
        let deferred = [ToolName::new("add").expect("a name")];
        let with_deferred = request.with_deferred_tools(&deferred);
        let none = ToolChoice::None;
        let other_choice = request.with_tool_choice(&none);
        let changed = [
            get(&request, "other model", 0),
            get(&request, "m", 1),
            get(&other_system, "m", 0),
            get(&other_tools, "m", 0),
            get(&other_settings, "m", 0),
            get(&with_schema, "m", 0),
            get(&with_deferred, "m", 0),
            get(&other_choice, "m", 0),
        ];
        assert_eq!(builds.get(), 1 + changed.len());
        for frame in &changed {
            assert!(!Arc::ptr_eq(&first, frame));
        }
        // Four are kept: the last four are found again, the first was
        // dropped for them.
        let last = get(&other_choice, "m", 0);
        assert!(Arc::ptr_eq(&last, &changed[changed.len() - 1]));
        assert_eq!(builds.get(), 1 + changed.len());
        get(&request, "m", 0);
        assert_eq!(builds.get(), 2 + changed.len());
    }

    #[test]
    fn a_refused_frame_is_not_kept() {
        let frames = FrameCache::<u8>::default();
        let settings = ModelSettings::default();
        let request = ModelRequest::new("", &[], &settings);
        let refused = frames.get_or_build(&request, "m", 0, || {
            Err(ModelError::InvalidRequest("no".into()))
        });
        assert!(refused.is_err());
        let builds = std::cell::Cell::new(0);
        frames
            .get_or_build(&request, "m", 0, || counted(&builds))
            .expect("a frame");
        assert_eq!(builds.get(), 1);
    }
}
