//! Property: every message survives a JSON round trip unchanged.

use markov_core::message::Message;
use markov_testkit::strategies::arb_message;
use proptest::prelude::*;

proptest! {
    #[test]
    fn message_json_round_trip(message in arb_message()) {
        let json = serde_json::to_string(&message).expect("serializes");
        let back: Message = serde_json::from_str(&json).expect("deserializes");
        prop_assert_eq!(back, message);
    }
}
