//! [`ToolErrorKind`]: why a call failed, the `type` of the error envelope,
//! from one table (wire name, retryability, the message the model reads).

use std::fmt;

macro_rules! kinds {
    ($(
        $(#[$doc:meta])*
        $variant:ident => $name:literal, retryable: $retry:literal, $message:literal;
    )*) => {
        /// Why a call failed: the `type` of the error envelope.
        ///
        /// Each kind's wire name, default retryability and model-facing
        /// message come from one table.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[non_exhaustive]
        pub enum ToolErrorKind {
            $( $(#[$doc])* $variant, )*
        }

        impl ToolErrorKind {
            /// Every kind, in table order.
            pub const ALL: &'static [ToolErrorKind] = &[$(ToolErrorKind::$variant),*];

            /// The wire name (`"NOT_FOUND"`, ...).
            pub fn as_str(self) -> &'static str {
                match self { $(ToolErrorKind::$variant => $name,)* }
            }

            /// Whether the model may retry the same call as it is.
            pub fn retryable(self) -> bool {
                match self { $(ToolErrorKind::$variant => $retry,)* }
            }

            /// The kind of a wire name (`"NOT_FOUND"`, ...).
            pub fn from_wire(name: &str) -> Option<Self> {
                match name { $($name => Some(ToolErrorKind::$variant),)* _ => None }
            }

            /// The message the model reads (before any detail).
            pub fn message(self) -> &'static str {
                match self { $(ToolErrorKind::$variant => $message,)* }
            }
        }
    };
}

kinds! {
    /// The tool is not registered, or not available to this leaf.
    NotFound => "NOT_FOUND", retryable: false, "Unknown tool";
    /// The tool is not allowed in the session's mode.
    ModeRestricted => "MODE_RESTRICTED", retryable: false, "Tool not available in this mode";
    /// A per-turn call budget is used up.
    BudgetExceeded => "BUDGET_EXCEEDED", retryable: false, "Tool call budget exceeded for this turn";
    /// The tool needs the user's approval; a request was issued.
    ConfirmationRequired => "CONFIRMATION_REQUIRED", retryable: false, "This action requires the user's approval";
    /// The confirmation token names a request the application has not approved yet.
    ConfirmationPending => "CONFIRMATION_PENDING", retryable: false, "The user has not approved this action yet";
    /// The application denied the request the token names.
    ConfirmationDenied => "CONFIRMATION_DENIED", retryable: false, "The user declined this action";
    /// The confirmation token is unknown, used, expired, or for another call.
    ConfirmationInvalid => "CONFIRMATION_INVALID", retryable: false, "The confirmation token is invalid, used or expired";
    /// A paused call's request expired before an approval was used.
    ConfirmationExpired => "CONFIRMATION_EXPIRED", retryable: false, "The user's approval expired before this action ran";
    /// The leaf repeated an identical call too often in this user turn.
    RepeatedCall => "REPEATED_CALL", retryable: false, "Not run: this exact call was repeated too often";
    /// The call id was already used by a call with another tool or other arguments.
    IdempotencyConflict => "IDEMPOTENCY_CONFLICT", retryable: false, "Duplicate call id";
    /// The arguments do not fit the tool's input.
    InvalidInput => "INVALID_INPUT", retryable: true, "Invalid tool input";
    /// The tool did not finish within its timeout.
    Timeout => "TIMEOUT", retryable: true, "Tool timed out";
    /// The tool ran and failed.
    ExecutionFailed => "EXECUTION_FAILED", retryable: false, "Tool execution failed";
    /// An at-most-once call started and its result was never recorded (the
    /// process died): its outcome is unknown, and it was not run again.
    Interrupted => "INTERRUPTED", retryable: false, "Interrupted: this call started, its outcome is unknown, and it was not run again";
}

impl fmt::Display for ToolErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
