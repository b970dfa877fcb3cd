//! Context views: what a model call is sent of a long history under a
//! [`ContextPolicy`].
//!
//! The history is never changed. A view is an owned list of messages kept
//! beside it, one per policy per machine ([`ContextViews`]), and kept up to
//! date incrementally: each step appends the messages recorded since the
//! last one (a clone of each new message, nothing else), and only a
//! compaction — a cut at a turn's start, tool results stubbed, a summary
//! put first — rebuilds it. The view has its own [`HistoryId`], kept while
//! it is only appended to and replaced by a fresh one at every compaction,
//! so a provider's cache of encoded messages serves the view as it serves
//! a history, and never sends the bytes of messages the view no longer
//! holds.
//!
//! Cuts fall only where a turn starts (a user message that is not tool
//! results), so a tool call and its result are both in or both out, the
//! view starts with a user message, and the current turn is always whole.
//! The summary is shown as the first text of that user message (the
//! history keeps it as a `summary` message of its own), so a view never
//! has two user messages in a row where its history has none: vendors
//! and chat templates that insist on alternating roles take it as it is.
//!
//! A native summary (the vendor's own compaction, `Summarize::native`) is
//! shown as a summary message of its own holding the vendor's items, and
//! only in a view for a model that reads that vendor's items
//! ([`native_reads`]); any other view passes over it to an earlier summary
//! or to the messages it stands for, which the history still holds.
//!
//! Each view keeps the estimated tokens of its messages as they are
//! appended, and [`ContextViews`] keeps those of the whole history for
//! calls made without a policy, so checking a usage limit never walks the
//! history.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use markov_charter::context::ContextPolicy;
use markov_core::message::{Item, Items, Message, NativeItems, Role};
use markov_core::model::HistoryId;
use markov_core::tokens;

/// How a summary is shown to the model, before its text.
pub const SUMMARY_PREAMBLE: &str =
    "[Summary of the earlier conversation, whose messages are left out here]\n\n";

/// The longest a tool result or a text is quoted in a summarizer's
/// transcript, in bytes; the rest is marked as left out.
const TRANSCRIPT_QUOTE: usize = 4_000;

/// The context views of one machine, one per policy its nodes use.
///
/// Kept beside the history and never serialized: a restored machine
/// builds its views again from its history, the summaries included.
#[derive(Debug, Default)]
pub struct ContextViews {
    views: Mutex<HashMap<u64, ViewState>>,
    /// The exact token counts of the views, for policies that ask for them.
    pub(crate) counts: crate::count::ExactCounts,
    history: Mutex<HistoryTokens>,
    /// The policies whose native compaction was warned about (a model
    /// without one, items its model cannot read): warned once each.
    native_warned: Mutex<std::collections::HashSet<u64>>,
}

/// The estimated tokens of a whole history, kept as it is appended to
/// (for calls made without a context policy).
#[derive(Debug, Default)]
struct HistoryTokens {
    /// The history they were counted for.
    id: Option<HistoryId>,
    /// How much of it is counted.
    synced: usize,
    /// The sum of its messages' estimates.
    tokens: u64,
}

/// A view ready for a request: its messages, its identity and their
/// estimated tokens.
#[derive(Debug, Clone)]
pub(crate) struct ViewRef {
    /// The messages the call is sent, shared with the view.
    pub(crate) messages: Arc<Vec<Message>>,
    /// The view's identity, for a provider's cache of encoded messages.
    pub(crate) id: HistoryId,
    /// [`tokens::estimate_messages`] of the messages, kept as they were
    /// appended.
    pub(crate) tokens: u64,
}

/// Older messages of a view to summarize, taken out by
/// [`ContextViews::prepare`] or [`ContextViews::force`].
#[derive(Debug, Clone)]
pub(crate) struct SummaryJob {
    /// The transcript the summarizer reads (the previous summary first);
    /// empty for a native compaction.
    pub(crate) transcript: String,
    /// For a native compaction: the view's messages to compact, as the
    /// view shows them (a native summary shown first is sent as its
    /// items, so the vendor folds it into the new one).
    pub(crate) messages: Vec<Message>,
    /// The history positions the summary will stand for.
    start: u64,
    end: u64,
    /// The view's generation the job was taken from; a view changed since
    /// (by another leaf) does not take the summary.
    generation: u64,
}

/// What a view needs before the next call.
#[derive(Debug)]
pub(crate) enum Prepared {
    /// The view is ready.
    Ready(ViewRef),
    /// It passed the summary threshold: summarize, then
    /// [`ContextViews::apply_summary`].
    Summarize(SummaryJob),
}

/// The vendor tag of the native summaries a view of `policy` shows to
/// a model that reads `native`'s items (its [`Model::native_summaries`]):
/// those under a policy that compacts natively, else none. A view under a summarizer's prompt
/// never shows a native summary, even one its model could read: the
/// summarizer could not fold those items into the next summary, and the
/// messages they stand for would be lost to it.
///
/// [`Model::native_summaries`]: markov_core::Model::native_summaries
pub(crate) fn native_reads<'m>(policy: &ContextPolicy, native: Option<&'m str>) -> Option<&'m str> {
    policy.summarize().filter(|s| s.is_native()).and(native)
}

/// The view of `policy` in `views`, made from `history` if there is none
/// or it was made for a model that reads other native summaries.
fn view_of<'v>(
    views: &'v mut HashMap<u64, ViewState>,
    policy: &ContextPolicy,
    history: &[Message],
    reads: Option<&str>,
) -> &'v mut ViewState {
    let view = views
        .entry(policy.id())
        .or_insert_with(|| ViewState::build(policy, history, reads));
    if view.reads.as_deref() != reads {
        *view = ViewState::build(policy, history, reads);
    }
    view
}

impl ContextViews {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, ViewState>> {
        self.views.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the view of `policy`, as its last call was sent it, is the
    /// history as it is: no summary shown, no message left out before it,
    /// no tool result stubbed. The messages a provider never sends (commands,
    /// instance records) aside, such a call's request is then the one made
    /// over the history itself, so a recorded step can be rebuilt from the
    /// stored history. `false` when there is no such view.
    pub fn shows_history_as_is(&self, policy: &ContextPolicy) -> bool {
        self.lock()
            .get(&policy.id())
            .is_some_and(|view| !view.altered && view.summary.is_none())
    }

    /// The shape of the view of `policy` as its last call was sent it,
    /// from which that call's messages are rebuilt
    /// ([`ViewShape::messages`] over the history the call was made over);
    /// `None` when there is no such view. Costs the same however long the
    /// history: the summary is shared, not copied.
    pub fn view_shape(&self, policy: &ContextPolicy) -> Option<ViewShape> {
        self.lock().get(&policy.id()).map(ViewState::shape)
    }

    /// Brings the view of `policy` up to date with `history` and applies
    /// the policy's cuts and trims; asks for a summary when the view passed
    /// the threshold and has turns to summarize.
    ///
    /// `reads` is [`native_reads`] of the model the view is for: the
    /// native summaries it may show.
    pub(crate) fn prepare(
        &self,
        policy: &ContextPolicy,
        history: &[Message],
        reads: Option<&str>,
    ) -> Prepared {
        let mut views = self.lock();
        let view = view_of(&mut views, policy, history, reads);
        view.sync(policy, history);
        view.apply_rules(policy);
        if let Some(summarize) = policy.summarize()
            && view.tokens > summarize.threshold_tokens()
            && !view.backing_off()
            && let Some(job) = view.summary_job(summarize.kept_turns(), summarize.is_native())
        {
            return Prepared::Summarize(job);
        }
        Prepared::Ready(view.reference())
    }

    /// The view of `policy`, brought up to date and its cuts and trims
    /// applied as [`Self::prepare`] does, when its estimate passes the
    /// summary threshold and it has turns to summarize: what an exact
    /// count is asked for. `None` when no summary is due.
    pub(crate) fn summary_due(
        &self,
        policy: &ContextPolicy,
        history: &[Message],
        reads: Option<&str>,
    ) -> Option<ViewRef> {
        let summarize = policy.summarize()?;
        let mut views = self.lock();
        let view = view_of(&mut views, policy, history, reads);
        view.sync(policy, history);
        view.apply_rules(policy);
        (view.tokens > summarize.threshold_tokens() && view.can_summarize(summarize.kept_turns()))
            .then(|| view.reference())
    }

    /// The summarizer failed (or wrote nothing) on the view of `policy`:
    /// it is not asked again until the view has grown by a quarter of the
    /// threshold or a new turn has started, so a summarizer that is down
    /// costs one failed call per turn rather than one per step. A
    /// compaction forced by a context-length refusal still asks it.
    pub(crate) fn summary_failed(&self, policy: &ContextPolicy) {
        let Some(summarize) = policy.summarize() else {
            return;
        };
        let mut views = self.lock();
        if let Some(view) = views.get_mut(&policy.id()) {
            let growth = (summarize.threshold_tokens() / 4).max(1);
            view.backoff = Some(Backoff {
                tokens: view.tokens.saturating_add(growth),
                turn: view.current_turn(),
            });
        }
    }

    /// Notes that `policy`'s native compaction could not be used; whether
    /// this is the first time for the policy (the one to warn about).
    pub(crate) fn native_unavailable(&self, policy: u64) -> bool {
        self.native_warned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(policy)
    }

    /// The estimated tokens of `history` (the machine's, named `id`):
    /// [`tokens::estimate_messages`] of it, kept as it is appended to, so
    /// each call counts only the messages recorded since the last. A
    /// history that is another, or shorter than what was counted, is
    /// counted afresh.
    pub fn history_tokens(&self, history: &[Message], id: HistoryId) -> u64 {
        let mut kept = self.history.lock().unwrap_or_else(|p| p.into_inner());
        if kept.id != Some(id) || history.len() < kept.synced {
            *kept = HistoryTokens {
                id: Some(id),
                ..HistoryTokens::default()
            };
        }
        let new = tokens::estimate_messages(&history[kept.synced..]);
        kept.tokens = kept.tokens.saturating_add(new);
        kept.synced = history.len();
        kept.tokens
    }

    /// The view of `policy` as it is.
    pub(crate) fn current(
        &self,
        policy: &ContextPolicy,
        history: &[Message],
        reads: Option<&str>,
    ) -> ViewRef {
        let mut views = self.lock();
        view_of(&mut views, policy, history, reads).reference()
    }

    /// Puts `text`, the summary of `job`, first in the view in place of
    /// the messages it stands for; the summary message to append to the
    /// history, or `None` when the view changed since the job was taken.
    pub(crate) fn apply_summary(
        &self,
        policy: &ContextPolicy,
        job: SummaryJob,
        text: String,
    ) -> Option<Message> {
        let mut views = self.lock();
        let view = views.get_mut(&policy.id())?;
        if view.generation != job.generation {
            return None;
        }
        let message = Message::summary(text, job.start, job.end);
        view.put_summary(&message, job.end);
        Some(message)
    }

    /// Puts `native`, the vendor's compaction of `job`, first in the view
    /// in place of the messages it stands for, as
    /// [`Self::apply_summary`] puts a summary's text; the summary message
    /// to append, or `None` when the view changed since the job was taken
    /// or does not read `native`'s vendor (the caller checks that first).
    pub(crate) fn apply_native(
        &self,
        policy: &ContextPolicy,
        job: SummaryJob,
        native: NativeItems,
    ) -> Option<Message> {
        let mut views = self.lock();
        let view = views.get_mut(&policy.id())?;
        if view.generation != job.generation || view.reads.as_deref() != Some(&*native.vendor) {
            return None;
        }
        let message = Message::native_summary(native, job.start, job.end);
        view.put_summary(&message, job.end);
        Some(message)
    }

    /// The model refused the view as too long: everything before the
    /// current turn goes. With a summarizer, the job that summarizes it
    /// (apply it, or [`Self::drop_before_current`] if the summarizer
    /// fails); without one, it is dropped at once. `None` when the view
    /// holds the current turn only: nothing is left to take out.
    pub(crate) fn force(
        &self,
        policy: &ContextPolicy,
        history: &[Message],
        reads: Option<&str>,
    ) -> Forced {
        let mut views = self.lock();
        let view = view_of(&mut views, policy, history, reads);
        view.sync(policy, history);
        let Some(&current) = view.turns.last() else {
            return Forced::Nothing;
        };
        if current <= view.first() {
            return Forced::Nothing;
        }
        if let Some(summarize) = policy.summarize()
            && let Some(job) = view.summary_job(1, summarize.is_native())
        {
            return Forced::Summarize(job);
        }
        view.drop_before(current);
        Forced::Done
    }

    /// Drops everything before the current turn (a failed summarizer).
    pub(crate) fn drop_before_current(&self, policy: &ContextPolicy) {
        let mut views = self.lock();
        if let Some(view) = views.get_mut(&policy.id())
            && let Some(&current) = view.turns.last()
        {
            view.drop_before(current);
        }
    }
}

/// What [`ContextViews::force`] did.
#[derive(Debug)]
pub(crate) enum Forced {
    /// Nothing could be taken out: the current turn alone is too long.
    Nothing,
    /// Everything before the current turn is out.
    Done,
    /// Summarize this first.
    Summarize(SummaryJob),
}

/// The summary a view shows first.
#[derive(Debug)]
struct ShownSummary {
    /// The history positions it stands for.
    range: std::ops::Range<u64>,
    /// Its text, as the summarizer wrote it.
    text: String,
    /// The vendor's items of a native summary, shown as they are in a
    /// summary message of their own ([`Placement::Alone`]).
    native: Option<NativeItems>,
    /// Where the view shows it.
    placement: Placement,
    /// The summary message as the history holds it, shared with each
    /// [`ViewShape`] that names it.
    message: Arc<Message>,
}

/// Where a view shows its summary.
#[derive(Debug)]
enum Placement {
    /// Nowhere yet: the view has no message to show it with.
    Pending,
    /// As the first item of the view's first message, a user message that
    /// starts a turn and is `original` in the history.
    Merged {
        /// The first message as the history has it.
        original: Box<Message>,
    },
    /// As a message of its own, first in the view: a native summary's
    /// items, always (a summary message holding [`Item::Native`], which
    /// only the client of that vendor sends); a text summary only when
    /// the view's first message does not start a turn (a summary read
    /// back whose range ends inside a turn; markov's own never do), as a
    /// user message.
    Alone,
}

/// A view's pause after its summarizer failed: no new attempt until the
/// view has `tokens` or a turn other than `turn` is current.
#[derive(Debug, Clone, Copy)]
struct Backoff {
    tokens: u64,
    turn: u64,
}

/// One view.
#[derive(Debug)]
struct ViewState {
    id: HistoryId,
    /// Bumped at every compaction.
    generation: u64,
    messages: Arc<Vec<Message>>,
    /// The history position of each message of the view (a summary's is
    /// the position it was appended at, or `u64::MAX` before that).
    origin: Vec<u64>,
    /// The estimated tokens of each message of the view.
    cost: Vec<u64>,
    /// Their sum.
    tokens: u64,
    /// The indices in the view where turns start, in order.
    turns: Vec<usize>,
    /// How much of the history the view has read.
    synced: usize,
    /// The view's tool results before this index are stubbed.
    trimmed: usize,
    /// Set once the view left out or changed anything of the history the
    /// model would have read without a policy: messages before its start,
    /// a stubbed tool result, a summary message passed over.
    altered: bool,
    /// The summary the view shows first.
    summary: Option<ShownSummary>,
    /// Set while a failed summarizer is not asked again.
    backoff: Option<Backoff>,
    /// The vendor of the native summaries the view may show (see
    /// [`native_reads`]).
    reads: Option<String>,
}

/// What a call's view of the history was, as a description rather than
/// messages: where it started, up to where its tool results were stubbed,
/// and the summary it showed first. Its request is rebuilt from the
/// history it was made over ([`Self::messages`]), so recording it costs
/// the same however long the history.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ViewShape {
    /// The history position of the view's first message after its
    /// summary: the messages before it were left out. The messages from
    /// it on are the history's, but for the records a provider never
    /// sends (commands, instance records, summary messages) and the
    /// results stubbed.
    pub from: u64,
    /// The tool results of the messages from [`from`](Self::from) up to
    /// this history position were stubbed, each whose stub is shorter (or
    /// that had images) replaced by a line naming the tool, the call and
    /// the size left out.
    #[serde(default)]
    pub stubbed_to: u64,
    /// The summary message (as the history holds it) the view showed
    /// first, in place of the messages it stands for (kept once by a
    /// store, see [`markov_core::kept`]).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "markov_core::kept::serialize"
    )]
    pub summary: Option<Arc<Message>>,
    /// Whether the summary was shown as a message of its own (a native
    /// summary, or a text summary before a first message that does not
    /// start a turn), rather than as the first text of the first message.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub summary_alone: bool,
}

impl ViewShape {
    /// The messages the view showed, rebuilt from `history`: the messages
    /// the call was made over (the first ones of the history, as many as
    /// it had then). `None` when the shape does not fit `history` (it
    /// starts past its end, or names a summary that is not one).
    pub fn messages(&self, history: &[Message]) -> Option<Vec<Message>> {
        let from = usize::try_from(self.from).ok()?;
        let stubbed_to = usize::try_from(self.stubbed_to)
            .unwrap_or(usize::MAX)
            .min(history.len());
        let mut names = HashMap::new();
        let mut messages = Vec::with_capacity(history.len().saturating_sub(from) + 1);
        for (at, message) in history.get(from..)?.iter().enumerate() {
            if matches!(message.role, Role::Command | Role::Instance | Role::Summary) {
                continue;
            }
            let mut message = message.clone();
            if from + at < stubbed_to {
                stub_message(&mut message, &mut names);
            }
            messages.push(message);
        }
        let Some(summary) = &self.summary else {
            return Some(messages);
        };
        let (text, _, native) = summary.as_summary_item()?;
        match (native, self.summary_alone) {
            (Some(native), _) => messages.insert(0, native_message(native)),
            (None, true) => messages.insert(0, Message::user_items(vec![summary_item(text)])),
            (None, false) => {
                // Shown in the first message, which the view needs.
                let first = messages.first_mut()?;
                *first = with_summary(text, first);
            }
        }
        Some(messages)
    }
}

/// Whether `message` starts a turn: a user message that is not tool results.
fn starts_turn(message: &Message) -> bool {
    message.role == Role::User
        && !message
            .item_list()
            .iter()
            .any(|i| matches!(i, Item::ToolResult { .. }))
}

/// How a view shows a native summary: a summary message of its own
/// holding the vendor's items, sent by that vendor's client alone.
fn native_message(native: &NativeItems) -> Message {
    Message::from(markov_core::message::MessageData {
        role: Role::Summary,
        items: Items::List(vec![Item::Native {
            vendor: native.vendor.clone(),
            items: native.items.clone(),
        }]),
        metadata: None,
    })
}

/// Whether a view that reads `reads` shows a summary whose native part is
/// `native`: a text summary always, a native one only to its vendor.
fn shows(native: Option<&NativeItems>, reads: Option<&str>) -> bool {
    native.is_none_or(|n| reads == Some(n.vendor.as_str()))
}

/// The stub a view shows in place of a tool result's `content` and
/// `images` (of the call `id` of the tool `name`), or `None` when the
/// result is shorter than its stub and holds no image.
fn result_stub(
    name: &str,
    id: &str,
    content: &str,
    images: &[markov_core::message::ImageData],
) -> Option<String> {
    let mut stub = format!(
        "[Result left out of the context: {name}, call {id}, {} bytes]",
        content.len()
    );
    for image in images {
        stub.push('\n');
        stub.push_str(&image.note());
    }
    (stub.len() < content.len() || !images.is_empty()).then_some(stub)
}

/// Stubs the tool results of `message` as a view stubs them, the tools'
/// names read from the calls seen so far (`names`, to which the message's
/// own calls are added). A message shared with the history is copied
/// only when one of its results is stubbed.
fn stub_message(message: &mut Message, names: &mut HashMap<String, String>) -> bool {
    let mut stubs = Vec::new();
    for (at, item) in message.item_list().iter().enumerate() {
        match item {
            Item::ToolUse { id, name, .. } => {
                names.insert(id.as_str().to_owned(), name.clone());
            }
            Item::ToolResult {
                tool_use_id,
                content,
                images,
                ..
            } => {
                let name = names
                    .get(tool_use_id.as_str())
                    .map_or("a tool", String::as_str);
                if let Some(stub) = result_stub(name, tool_use_id.as_str(), content, images) {
                    stubs.push((at, stub));
                }
            }
            _ => {}
        }
    }
    if stubs.is_empty() {
        return false;
    }
    let Items::List(items) = &mut message.make_mut().items else {
        return false;
    };
    for (at, stub) in stubs {
        if let Some(Item::ToolResult {
            content, images, ..
        }) = items.get_mut(at)
        {
            *content = stub;
            images.clear();
        }
    }
    true
}

/// The text a view shows a summary as.
fn summary_item(text: &str) -> Item {
    Item::text(format!("{SUMMARY_PREAMBLE}{text}"))
}

/// `message` (a user message that starts a turn) with the summary's text
/// as its first item.
fn with_summary(text: &str, message: &Message) -> Message {
    let mut items = vec![summary_item(text)];
    match &message.items {
        Items::Text(own) => items.push(Item::text(own.clone())),
        Items::List(own) => items.extend(own.iter().cloned()),
        Items::Instance(_) => {}
    }
    Message::from(markov_core::message::MessageData {
        role: message.role,
        items: Items::List(items),
        metadata: message.metadata.clone(),
    })
}

impl ViewState {
    fn empty(reads: Option<&str>) -> Self {
        ViewState {
            reads: reads.map(str::to_owned),
            id: HistoryId::fresh(),
            generation: 0,
            messages: Arc::new(Vec::new()),
            origin: Vec::new(),
            cost: Vec::new(),
            tokens: 0,
            turns: Vec::new(),
            synced: 0,
            trimmed: 0,
            altered: false,
            summary: None,
            backoff: None,
        }
    }

    /// The view of `history` from scratch: the latest summary first, then
    /// what follows the messages it stands for, cut to the policy's last
    /// turns. Reads the history from its end, only as far as the summary
    /// or the first turn kept.
    ///
    /// A native summary of a vendor the view does not read is passed over
    /// (an earlier summary, or the messages themselves, stand in).
    fn build(policy: &ContextPolicy, history: &[Message], reads: Option<&str>) -> Self {
        let mut view = ViewState::empty(reads);
        let mut start = 0usize;
        let latest = history.iter().enumerate().rev().find_map(|(at, m)| {
            m.as_summary_item()
                .filter(|(_, _, native)| shows(*native, reads))
                .map(|(text, range, native)| (at, text, range, native))
        });
        if let Some((at, text, range, native)) = latest {
            start = usize::try_from(range.end).unwrap_or(usize::MAX).min(at);
            // Shown with the first message the view takes.
            view.summary = Some(ShownSummary {
                range,
                text: text.to_owned(),
                native: native.cloned(),
                placement: Placement::Pending,
                message: Arc::new(history[at].clone()),
            });
        }
        if let Some(keep) = policy.keep_last_turns() {
            let mut seen = 0;
            for at in (start..history.len()).rev() {
                if starts_turn(&history[at]) {
                    seen += 1;
                    if seen == keep {
                        start = at;
                        break;
                    }
                }
            }
        }
        view.synced = start;
        view.altered = start > 0;
        view.sync(policy, history);
        view
    }

    /// The view's [`ViewShape`].
    fn shape(&self) -> ViewShape {
        let first = self.first();
        let position = |index: usize| {
            self.origin
                .get(index)
                .copied()
                .unwrap_or(self.synced as u64)
        };
        let from = position(first);
        let shown = self
            .summary
            .as_ref()
            .filter(|s| !matches!(s.placement, Placement::Pending));
        ViewShape {
            from,
            stubbed_to: if self.trimmed > first {
                position(self.trimmed)
            } else {
                from
            },
            summary: shown.map(|s| Arc::clone(&s.message)),
            summary_alone: shown.is_some_and(|s| matches!(s.placement, Placement::Alone)),
        }
    }

    fn reference(&self) -> ViewRef {
        ViewRef {
            messages: Arc::clone(&self.messages),
            id: self.id,
            tokens: self.tokens,
        }
    }

    /// The index of the view's first message that is not a summary of
    /// its own (1 only while the summary is shown [`Placement::Alone`]).
    fn first(&self) -> usize {
        usize::from(matches!(
            self.summary,
            Some(ShownSummary {
                placement: Placement::Alone,
                ..
            })
        ))
    }

    /// The history position of the current turn's start (`u64::MAX`
    /// before any).
    fn current_turn(&self) -> u64 {
        self.turns.last().map_or(u64::MAX, |&at| self.origin[at])
    }

    /// Whether a failed summarizer is not to be asked again yet.
    fn backing_off(&self) -> bool {
        self.backoff
            .is_some_and(|b| self.tokens < b.tokens && self.current_turn() == b.turn)
    }

    /// Appends `message`, recorded at history position `origin`. The first
    /// message of a view whose summary waits for one shows the summary.
    fn push(&mut self, origin: u64, message: Message) {
        if self.messages.is_empty()
            && let Some(summary) = &self.summary
            && matches!(summary.placement, Placement::Pending)
        {
            self.push_raw(origin, message, true);
            self.place_summary();
            return;
        }
        self.push_raw(origin, message, true);
    }

    /// Appends `message` as it is; `turn` when it may start a turn (a
    /// summary of its own never does).
    fn push_raw(&mut self, origin: u64, message: Message, turn: bool) {
        let cost = tokens::estimate_message(&message);
        if turn && starts_turn(&message) {
            self.turns.push(self.messages.len());
        }
        self.tokens += cost;
        self.cost.push(cost);
        self.origin.push(origin);
        Arc::make_mut(&mut self.messages).push(message);
    }

    /// Shows a [`Placement::Pending`] summary: in the view's first message
    /// when it starts a turn (the usual case), else as a message of its
    /// own before it. Nothing while the view is empty. Keeps `tokens` up
    /// to date.
    fn place_summary(&mut self) {
        let Some(summary) = &mut self.summary else {
            return;
        };
        if !matches!(summary.placement, Placement::Pending) || self.messages.is_empty() {
            return;
        }
        let messages = Arc::make_mut(&mut self.messages);
        let old = self.cost[0];
        if summary.native.is_none() && starts_turn(&messages[0]) {
            let shown = with_summary(&summary.text, &messages[0]);
            let original = std::mem::replace(&mut messages[0], shown);
            summary.placement = Placement::Merged {
                original: Box::new(original),
            };
            self.cost[0] = tokens::estimate_message(&messages[0]);
            self.tokens = self.tokens - old + self.cost[0];
            return;
        }
        let shown = match &summary.native {
            Some(native) => native_message(native),
            None => Message::user_items(vec![summary_item(&summary.text)]),
        };
        let cost = tokens::estimate_message(&shown);
        messages.insert(0, shown);
        summary.placement = Placement::Alone;
        self.origin.insert(0, u64::MAX);
        self.cost.insert(0, cost);
        self.tokens += cost;
        for t in &mut self.turns {
            *t += 1;
        }
        self.trimmed += 1;
    }

    /// Takes the summary out of the view's messages (back to
    /// [`Placement::Pending`]), before the messages it is shown with
    /// change: the first message is the history's again, a summary of its
    /// own is removed. Keeps `tokens` up to date.
    fn unplace_summary(&mut self) {
        let Some(summary) = &mut self.summary else {
            return;
        };
        match std::mem::replace(&mut summary.placement, Placement::Pending) {
            Placement::Pending => {}
            Placement::Merged { original } => {
                let messages = Arc::make_mut(&mut self.messages);
                messages[0] = *original;
                let old = self.cost[0];
                self.cost[0] = tokens::estimate_message(&messages[0]);
                self.tokens = self.tokens - old + self.cost[0];
            }
            Placement::Alone => {
                Arc::make_mut(&mut self.messages).remove(0);
                self.origin.remove(0);
                self.tokens -= self.cost.remove(0);
                for t in &mut self.turns {
                    *t -= 1;
                }
                self.trimmed = self.trimmed.saturating_sub(1);
            }
        }
    }

    /// Appends what the history recorded since the last call: each new
    /// message once. A summary the view does not show yet (another
    /// process's, another leaf's) makes it build again.
    fn sync(&mut self, policy: &ContextPolicy, history: &[Message]) {
        if history.len() < self.synced {
            *self = ViewState::build(policy, history, self.reads.as_deref());
            return;
        }
        for at in self.synced..history.len() {
            let message = &history[at];
            match message.role {
                Role::Command | Role::Instance => {}
                Role::Summary => {
                    let reads = self.reads.clone();
                    let reads = reads.as_deref();
                    let newer = match (message.as_summary_item(), &self.summary) {
                        (Some((_, _, native)), _) if !shows(native, reads) => false,
                        (Some((_, range, _)), Some(shown)) => range.end > shown.range.end,
                        (Some(_), None) => true,
                        (None, _) => false,
                    };
                    if newer {
                        *self = ViewState::build(policy, history, reads);
                        return;
                    }
                    self.altered = true;
                }
                _ => self.push(at as u64, message.clone()),
            }
        }
        self.synced = history.len();
    }

    /// Starts a new cached prefix: the view's messages changed.
    fn compacted(&mut self) {
        self.id = HistoryId::fresh();
        self.generation += 1;
    }

    /// The policy's cuts and trims, each only when it has something to do.
    fn apply_rules(&mut self, policy: &ContextPolicy) {
        if let Some(keep) = policy.keep_last_turns()
            && self.turns.len() > keep
        {
            let cut = self.turns[self.turns.len() - keep];
            self.drop_before(cut);
        }
        if let Some(keep) = policy.trim_tool_results()
            && self.turns.len() > keep
        {
            let boundary = self.turns[self.turns.len() - keep];
            self.trim_before(boundary);
        }
    }

    /// Leaves out the view's messages before index `cut` (a turn's start);
    /// the summary moves to the first message kept.
    fn drop_before(&mut self, cut: usize) {
        let first = self.first();
        if cut <= first {
            return;
        }
        self.unplace_summary();
        self.remove_front(cut - first);
        self.place_summary();
        self.tokens = self.cost.iter().sum();
        self.altered = true;
        self.compacted();
    }

    /// Removes the view's first `n` messages (the summary taken out).
    fn remove_front(&mut self, n: usize) {
        Arc::make_mut(&mut self.messages).drain(..n);
        self.origin.drain(..n);
        self.cost.drain(..n);
        self.turns.retain(|&t| t >= n);
        for t in &mut self.turns {
            *t -= n;
        }
        self.trimmed = self.trimmed.saturating_sub(n);
    }

    /// Stubs the tool results of the view's messages before index
    /// `boundary` (a turn's start) that are not stubbed yet.
    fn trim_before(&mut self, boundary: usize) {
        let from = self.trimmed.max(self.first());
        if boundary <= from {
            return;
        }
        let mut names: HashMap<String, String> = HashMap::new();
        let mut changed = false;
        let messages = Arc::make_mut(&mut self.messages);
        let costs = &mut self.cost[from..boundary];
        for (message, cost) in messages[from..boundary].iter_mut().zip(costs) {
            let touched = stub_message(message, &mut names);
            if touched {
                let stubbed = tokens::estimate_message(message);
                self.tokens = self.tokens - *cost + stubbed;
                *cost = stubbed;
                changed = true;
            }
        }
        self.trimmed = boundary;
        if changed {
            self.altered = true;
            self.compacted();
        }
    }

    /// Whether [`Self::summary_job`] would find turns to summarize.
    fn can_summarize(&self, keep: usize) -> bool {
        self.turns.len() > keep && self.turns[self.turns.len() - keep] > self.first()
    }

    /// The job that summarizes every turn but the last `keep` (and the
    /// summary already shown), with a transcript for a summarizer or, when
    /// `native`, the messages for the vendor's compaction; `None` when
    /// there is none to summarize.
    fn summary_job(&self, keep: usize, native: bool) -> Option<SummaryJob> {
        if self.turns.len() <= keep {
            return None;
        }
        let cut = self.turns[self.turns.len() - keep];
        let first = self.first();
        if cut <= first {
            return None;
        }
        let start = self
            .summary
            .as_ref()
            .map_or(self.origin[first], |summary| summary.range.start);
        if native {
            return Some(SummaryJob {
                transcript: String::new(),
                messages: self.messages[..cut].to_vec(),
                start,
                end: self.origin[cut],
                generation: self.generation,
            });
        }
        let mut transcript = String::new();
        let start = match &self.summary {
            Some(summary) => {
                transcript.push_str("Summary of what came before:\n");
                transcript.push_str(&summary.text);
                transcript.push_str("\n\nThen:\n");
                summary.range.start
            }
            None => self.origin[first],
        };
        for (at, message) in self.messages[first..cut].iter().enumerate() {
            // The first message reads as the history has it, without the
            // summary shown in it.
            let message = match &self.summary {
                Some(ShownSummary {
                    placement: Placement::Merged { original },
                    ..
                }) if at == 0 => original,
                _ => message,
            };
            render(message, &mut transcript);
        }
        Some(SummaryJob {
            transcript,
            messages: Vec::new(),
            start,
            end: self.origin[cut],
            generation: self.generation,
        })
    }

    /// Puts `summary` first in place of the messages before history
    /// position `end`.
    fn put_summary(&mut self, summary: &Message, end: u64) {
        let Some((text, range, native)) = summary.as_summary_item() else {
            return;
        };
        self.unplace_summary();
        // The messages before `cut` (an older summary's among them) are
        // what the new summary stands for.
        let cut = self
            .origin
            .iter()
            .position(|&o| o >= end)
            .unwrap_or(self.messages.len());
        self.remove_front(cut);
        self.summary = Some(ShownSummary {
            range,
            text: text.to_owned(),
            native: native.cloned(),
            placement: Placement::Pending,
            message: Arc::new(summary.clone()),
        });
        self.place_summary();
        self.tokens = self.cost.iter().sum();
        self.backoff = None;
        self.compacted();
    }
}

/// Appends `message` to a summarizer's transcript, as plain lines.
fn render(message: &Message, out: &mut String) {
    let who = match message.role {
        Role::User => "User",
        Role::Assistant => "Assistant",
        Role::System => "System",
        Role::Ephemeral => "Context",
        _ => return,
    };
    let quote = |text: &str, out: &mut String| {
        if text.len() <= TRANSCRIPT_QUOTE {
            out.push_str(text);
        } else {
            let mut end = TRANSCRIPT_QUOTE;
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            out.push_str(&text[..end]);
            out.push_str(&format!(" […{} bytes left out]", text.len() - end));
        }
    };
    match &message.items {
        Items::Text(text) => {
            out.push_str(who);
            out.push_str(": ");
            quote(text, out);
            out.push('\n');
        }
        Items::List(items) => {
            for item in items {
                match item {
                    Item::Text { text } => {
                        out.push_str(who);
                        out.push_str(": ");
                        quote(text, out);
                        out.push('\n');
                    }
                    Item::ToolUse { name, input, .. } => {
                        out.push_str(&format!("{who} called the tool {name} with "));
                        quote(&input.to_string(), out);
                        out.push('\n');
                    }
                    Item::ToolResult {
                        content, images, ..
                    } => {
                        out.push_str("Tool result: ");
                        quote(content, out);
                        out.push('\n');
                        // A summarizer reads text: an image is its note.
                        for image in images {
                            out.push_str("Tool result image: ");
                            out.push_str(&image.note());
                            out.push('\n');
                        }
                    }
                    Item::Output { data } => {
                        out.push_str(who);
                        out.push_str(": ");
                        quote(&data.to_string(), out);
                        out.push('\n');
                    }
                    _ => {}
                }
            }
        }
        Items::Instance(_) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use markov_charter::context::Summarize;
    use proptest::prelude::*;
    use serde_json::json;

    /// The vendor tag of the native summaries in these tests.
    const VENDOR: &str = "test.vendor";

    #[derive(Debug)]
    struct Never;

    #[markov_core::async_trait]
    impl markov_core::Model for Never {
        async fn complete(
            &self,
            _request: markov_core::ModelRequest<'_>,
        ) -> Result<markov_core::ModelResponse, markov_core::ModelError> {
            Err(markov_core::ModelError::InvalidRequest("not called".into()))
        }
    }

    /// A turn of the history: a question, `calls` tool calls with their
    /// results (each `size` bytes), an answer.
    fn push_turn(history: &mut Vec<Message>, n: usize, calls: usize, size: usize) {
        history.push(Message::user(format!("question {n}")));
        for c in 0..calls {
            let id = format!("t{n}_{c}");
            history.push(Message::assistant_items(vec![Item::tool_use(
                id.as_str(),
                "add",
                json!({"a": c}),
            )]));
            history.push(Message::user_items(vec![Item::tool_result(
                id.as_str(),
                "r".repeat(size),
                Some(false),
            )]));
        }
        history.push(Message::assistant(format!("answer {n}")));
    }

    /// The view's message at `i` as the history has it: the first one
    /// without the summary shown in it.
    fn unmerged(view: &ViewState, i: usize) -> &Message {
        match &view.summary {
            Some(ShownSummary {
                placement: Placement::Merged { original },
                ..
            }) if i == 0 => original,
            _ => &view.messages[i],
        }
    }

    /// Whether two user messages follow each other in `messages` (the
    /// records never sent left out).
    fn users_in_a_row<'a>(messages: impl IntoIterator<Item = &'a Message>) -> bool {
        let roles: Vec<Role> = messages
            .into_iter()
            .map(|m| m.role)
            .filter(|r| !matches!(r, Role::Command | Role::Instance | Role::Summary))
            .collect();
        roles
            .windows(2)
            .any(|w| w[0] == Role::User && w[1] == Role::User)
    }

    /// What must hold of a view whatever happened to it.
    fn check(view: &ViewState, history: &[Message], policy: &ContextPolicy) {
        let first = view.first();
        if let Some(keep) = policy.trim_tool_results()
            && view.turns.len() > keep
        {
            let boundary = view.turns[view.turns.len() - keep];
            for message in &view.messages[first..boundary] {
                for item in message.item_list() {
                    if let Item::ToolResult { content, .. } = item {
                        assert!(
                            content.starts_with("[Result left out") || content.len() < 60,
                            "an old result is stubbed: {content}"
                        );
                    }
                }
            }
        }
        assert_eq!(view.messages.len(), view.origin.len());
        assert_eq!(view.messages.len(), view.cost.len());
        assert_eq!(view.tokens, view.cost.iter().sum::<u64>());
        assert_eq!(
            view.tokens,
            tokens::estimate_messages(&view.messages),
            "the costs are the messages'"
        );
        let starts: Vec<usize> = (first..view.messages.len())
            .filter(|&i| starts_turn(&view.messages[i]))
            .collect();
        assert_eq!(view.turns, starts, "the turn starts");
        if view.messages.len() > first {
            assert!(
                starts_turn(&view.messages[first]),
                "a cut at a turn's start"
            );
        }
        match &view.summary {
            Some(ShownSummary {
                text,
                placement: Placement::Merged { original },
                ..
            }) => {
                assert_eq!(view.messages[0], with_summary(text, original));
                assert!(view.messages[0].text().starts_with(SUMMARY_PREAMBLE));
            }
            Some(ShownSummary {
                placement: Placement::Alone,
                native: Some(native),
                ..
            }) => {
                assert_eq!(view.messages[0], native_message(native));
                assert_eq!(view.reads.as_deref(), Some(native.vendor.as_str()));
            }
            Some(ShownSummary {
                placement: Placement::Alone,
                ..
            }) => {
                assert!(view.messages[0].text().starts_with(SUMMARY_PREAMBLE));
            }
            Some(ShownSummary {
                placement: Placement::Pending,
                ..
            }) => assert!(view.messages.is_empty(), "a summary waits for a message"),
            None => {}
        }
        for i in first..view.messages.len() {
            let at = usize::try_from(view.origin[i]).unwrap();
            let original = &history[at];
            assert_eq!(original.role, view.messages[i].role);
            if i >= view.trimmed {
                assert_eq!(
                    original,
                    unmerged(view, i),
                    "untrimmed messages are the history's"
                );
            }
        }
        // The view's shape rebuilds its messages from the history it read.
        assert_eq!(
            view.shape().messages(&history[..view.synced]).as_ref(),
            Some(&*view.messages),
            "the shape rebuilds the view"
        );
        // Origins increase: the view keeps the history's order.
        assert!(view.origin[first..].windows(2).all(|w| w[0] < w[1]));
        // A view that altered nothing is the history as a provider sends it.
        if !view.altered && view.summary.is_none() {
            let sent: Vec<&Message> = history
                .iter()
                .filter(|m| !matches!(m.role, Role::Command | Role::Instance))
                .collect();
            assert_eq!(
                view.messages.iter().collect::<Vec<_>>(),
                sent,
                "a view that altered nothing is the history as it is"
            );
        }
        // The view ends with the history's last message.
        if let Some(last) = history.last()
            && last.role != Role::Summary
            && !view.messages.is_empty()
        {
            assert_eq!(unmerged(view, view.messages.len() - 1), last);
        }
        // Roles alternate in the view where they do in the history: the
        // summary is never a user message of its own before a user's.
        if !users_in_a_row(history) {
            assert!(
                !users_in_a_row(view.messages.iter()),
                "two user messages in a row"
            );
        }
    }

    #[test]
    fn a_view_is_appended_to_until_a_rule_cuts_it() {
        let policy = ContextPolicy::builder().keep_last_turns(2).build().unwrap();
        let views = ContextViews::default();
        let mut history = Vec::new();
        push_turn(&mut history, 0, 1, 10);
        let Prepared::Ready(first) = views.prepare(&policy, &history, None) else {
            panic!("no summary")
        };
        push_turn(&mut history, 1, 1, 10);
        let Prepared::Ready(second) = views.prepare(&policy, &history, None) else {
            panic!("no summary")
        };
        assert_eq!(first.id, second.id);
        assert!(second.messages.starts_with(&first.messages));
        drop((first, second));
        push_turn(&mut history, 2, 1, 10);
        let Prepared::Ready(third) = views.prepare(&policy, &history, None) else {
            panic!("no summary")
        };
        assert_eq!(third.messages[0].text(), "question 1");
        assert_eq!(third.messages.len(), 8);
    }

    #[test]
    fn a_view_shows_the_history_as_it_is_until_a_rule_changes_it() {
        let policy = ContextPolicy::builder()
            .keep_last_turns(3)
            .trim_tool_results(2)
            .build()
            .unwrap();
        let views = ContextViews::default();
        assert!(!views.shows_history_as_is(&policy), "no view yet");
        let mut history = Vec::new();
        push_turn(&mut history, 0, 1, 10);
        push_turn(&mut history, 1, 1, 10);
        let _ = views.prepare(&policy, &history, None);
        assert!(views.shows_history_as_is(&policy), "two short turns");
        // A third turn stubs the first turn's long result.
        push_turn(&mut history, 2, 1, 500);
        push_turn(&mut history, 3, 1, 10);
        let _ = views.prepare(&policy, &history, None);
        assert!(!views.shows_history_as_is(&policy), "a result stubbed");
        // Another view, made afresh over a history longer than its turns.
        let fresh = ContextViews::default();
        push_turn(&mut history, 4, 0, 0);
        let _ = fresh.prepare(&policy, &history, None);
        assert!(!fresh.shows_history_as_is(&policy), "turns left out");
    }

    proptest! {
        /// The history's estimate kept as it grows is core's estimate of
        /// it walked afresh, and with the framing it is the request's;
        /// another history, or a shorter one, is counted afresh.
        #[test]
        fn the_history_estimate_kept_equals_a_fresh_one(
            chunks in proptest::collection::vec(
                proptest::collection::vec(markov_testkit::strategies::arb_message(), 0..5),
                1..8,
            ),
        ) {
            let views = ContextViews::default();
            let id = HistoryId::fresh();
            let settings = markov_core::ModelSettings::default();
            let schema = json!({"type": "object", "properties": {"answer": {"type": "string"}}});
            let mut history = Vec::new();
            for chunk in chunks {
                history.extend(chunk);
                let kept = views.history_tokens(&history, id);
                prop_assert_eq!(kept, tokens::estimate_messages(&history));
                let request = markov_core::ModelRequest::new("You answer.", &history, &settings)
                    .with_output_schema(Some(&schema));
                prop_assert_eq!(
                    crate::usage::estimate_framing_tokens(&request) + kept,
                    crate::usage::estimate_input_tokens(&request)
                );
                prop_assert_eq!(
                    tokens::estimate_framing(&request) + kept,
                    tokens::estimate_request(&request)
                );
            }
            let shorter = &history[..history.len() / 2];
            prop_assert_eq!(views.history_tokens(shorter, id), tokens::estimate_messages(shorter));
            prop_assert_eq!(
                views.history_tokens(&history, HistoryId::fresh()),
                tokens::estimate_messages(&history)
            );
        }
    }

    proptest! {
        /// Any sequence of turns, summaries (some made, some refused) and
        /// forced compactions leaves a view whose bookkeeping is right.
        #[test]
        fn the_bookkeeping_holds_through_every_compaction(
            turns in proptest::collection::vec((0usize..3, 0usize..300, 0u8..4), 1..24),
            keep in proptest::option::of(1usize..5),
            trim in proptest::option::of(1usize..4),
            summarize in proptest::option::of((20u64..300, 1usize..3, any::<bool>())),
        ) {
            let mut policy = ContextPolicy::builder();
            if let Some(k) = keep { policy = policy.keep_last_turns(k); }
            if let Some(t) = trim { policy = policy.trim_tool_results(t); }
            let mut reads = None;
            if let Some((threshold, kept, native)) = summarize {
                let summarize = if native {
                    reads = Some(VENDOR);
                    Summarize::native(Arc::new(Never), threshold)
                } else {
                    Summarize::new(Arc::new(Never), threshold)
                };
                policy = policy.summarize(summarize.keep_last_turns(kept));
            }
            let Ok(policy) = policy.build() else { return Ok(()); };
            let views = ContextViews::default();
            let mut history = Vec::new();
            // A native summary is the vendor's compaction of exactly the
            // messages the job holds.
            let summary = |job: SummaryJob, text: String| match reads {
                Some(vendor) => {
                    let items = vec![format!("{{\"compacted\":{}}}", job.messages.len())];
                    views.apply_native(&policy, job, NativeItems::new(vendor, items))
                }
                None => views.apply_summary(&policy, job, text),
            };
            for (n, (calls, size, action)) in turns.into_iter().enumerate() {
                push_turn(&mut history, n, calls, size);
                match views.prepare(&policy, &history, reads) {
                    Prepared::Ready(_) => {}
                    Prepared::Summarize(job) => {
                        if action != 0
                            && let Some(summary) = summary(job, format!("summary {n}"))
                        {
                            history.push(summary);
                        }
                    }
                }
                if action == 3 {
                    match views.force(&policy, &history, reads) {
                        Forced::Summarize(job) => {
                            if let Some(summary) = summary(job, format!("forced {n}")) {
                                history.push(summary);
                            }
                        }
                        Forced::Done | Forced::Nothing => {}
                    }
                }
                let guard = views.lock();
                check(&guard[&policy.id()], &history, &policy);
                drop(guard);
                // A view built afresh from the history (a restored
                // machine) holds its bookkeeping too.
                let mut fresh = ViewState::build(&policy, &history, reads);
                fresh.apply_rules(&policy);
                check(&fresh, &history, &policy);
                // A view for a model of another vendor never holds the
                // native items.
                let mut foreign = ViewState::build(&policy, &history, Some("other.vendor"));
                foreign.apply_rules(&policy);
                check(&foreign, &history, &policy);
                prop_assert!(
                    foreign.messages.iter().flat_map(Message::item_list).all(|i| !matches!(i, Item::Native { .. })),
                    "a foreign model is shown no native items"
                );
            }
        }
    }
}
