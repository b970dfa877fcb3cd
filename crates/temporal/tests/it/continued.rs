//! A session whose history grows continues as new with its snapshot:
//! nothing of the conversation is lost across runs.

use crate::support::{Fixture, Server, TempDir, history, turns_done, user_messages};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grown_session_continues_as_new_with_its_history() {
    let Some(server) = Server::start() else {
        return;
    };
    let dir = TempDir::new("continued");
    // A turn of three steps makes more than 20 events.
    let fixture = Fixture::start_continuing(&server, &dir.0, 20);
    let client = server.client(&fixture.queue).await;

    for (turn, message) in ["record please", "and again", "once more"]
        .iter()
        .enumerate()
    {
        client.send("continued", message).await.expect("sent");
        turns_done(&client, "continued", turn as u64 + 1).await;
    }

    let runs = server.runs("continued");
    assert!(runs.len() >= 3, "each turn continued as new: {runs:?}");
    assert!(
        runs.iter()
            .filter(|r| r["status"]
                .as_str()
                .is_some_and(|s| s.contains("CONTINUED_AS_NEW")))
            .count()
            >= 2,
        "{runs:?}"
    );
    let history = history(&client, "continued").await;
    assert_eq!(user_messages(&history), 3, "{history:?}");
    assert_eq!(fixture.count("effects.log", "effect record first"), 1);
    assert_eq!(fixture.count("effects.log", "effect record second"), 1);
    assert_eq!(fixture.count("model.log", "begin 0"), 1);
}
