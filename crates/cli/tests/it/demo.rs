//! Runs the built `markov-demo` binary: with no provider configured it
//! rehearses on the scripted model, says so, and prints the answer; a bad
//! provider configuration is reported plainly with a failing status.

use std::process::Output;

use crate::fixtures::without_provider;

/// Runs the demo with the provider variables removed, then `set` applied.
fn demo(set: &[(&str, &str)]) -> Output {
    let mut command = without_provider(env!("CARGO_BIN_EXE_markov-demo"));
    command.envs(set.iter().copied());
    command.output().expect("the demo binary runs")
}

/// [`demo`] on a blocking thread, so that a fake server on the test's
/// runtime answers it.
async fn demo_off_runtime(set: &[(&str, &str)]) -> Output {
    let set: Vec<(String, String)> = set
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    tokio::task::spawn_blocking(move || {
        let set: Vec<(&str, &str)> = set.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        demo(&set)
    })
    .await
    .expect("the demo ran")
}

#[test]
fn without_a_provider_the_demo_rehearses_on_the_scripted_model() {
    let output = demo(&[]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{}\n{stdout}\n{stderr}",
        output.status
    );
    let first = stdout.lines().next().unwrap_or_default();
    assert_eq!(
        first,
        "model: scripted (no ANTHROPIC_API_KEY, GEMINI_API_KEY or OPENAI_API_KEY set; \
         this run is a rehearsal, not a real model)"
    );
    for expected in [
        "How many people live in Lisbon and Porto together?",
        "model calls population({\"city\":\"Lisbon\"})",
        "tool result: 545923",
        "model calls add(",
        "tool result: 777885",
        "Lisbon and Porto have 777885 inhabitants together.",
    ] {
        assert!(
            stdout.contains(expected),
            "{expected:?} missing from\n{stdout}"
        );
    }
    let last = stdout.lines().last().unwrap_or_default();
    assert!(
        last.ends_with("Lisbon and Porto have 777885 inhabitants together."),
        "{stdout}"
    );
    assert!(stderr.is_empty(), "{stderr}");
}

#[test]
fn blank_provider_variables_count_as_unset() {
    let output = demo(&[("ANTHROPIC_API_KEY", ""), ("OPENAI_API_KEY", "  ")]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    assert!(stdout.starts_with("model: scripted ("), "{stdout}");
}

#[test]
fn a_bad_provider_configuration_is_an_error_not_a_panic() {
    let output = demo(&[("OPENAI_BASE_URL", "not a url")]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.starts_with("error: cannot configure the model: "),
        "{stderr}"
    );
    // The value and the variable are named, with what to write instead.
    assert!(
        stderr.contains(r#"invalid base url "not a url" (from OPENAI_BASE_URL)"#),
        "{stderr}"
    );
    assert!(stderr.contains("it has no scheme"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stdout.is_empty(), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_local_messages_server_is_used_and_named_on_the_first_line() {
    use markov_testkit::http::{FakeServer, Reply, anthropic};
    use serde_json::json;

    let server = FakeServer::start().await;
    // No MARKOV_MODEL: the demo asks the server for its model (and its
    // context, which this one does not report).
    markov_testkit::http::openai::serve_without_context(&server, "local-model");
    server
        .reply(Reply::json(
            200,
            anthropic::message(
                "1",
                vec![
                    json!({"type": "tool_use", "id": "t1", "name": "population", "input": {"city": "Lisbon"}}),
                    json!({"type": "tool_use", "id": "t2", "name": "population", "input": {"city": "Porto"}}),
                ],
                "tool_use",
            ),
        ))
        .reply(Reply::json(
            200,
            anthropic::tool_use("t3", "add", &json!({"a": 545_923, "b": 231_962})),
        ))
        .reply(Reply::json(200, anthropic::text("777885 people, from a local server.")));
    let base = server.base_url();
    let output = demo_off_runtime(&[("ANTHROPIC_BASE_URL", base.as_str())]).await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let first = stdout.lines().next().unwrap_or_default();
    assert_eq!(
        first,
        format!(
            "model: anthropic messages api ({}/v1/messages, local-model)",
            server.base_url()
        ),
    );
    assert!(
        stdout.contains("777885 people, from a local server."),
        "{stdout}"
    );
    let requests = server.requests();
    assert_eq!(requests.len(), 6);
    assert_eq!(requests[0].path, "/v1/models");
    let calls: Vec<_> = requests.iter().filter(|r| r.method == "POST").collect();
    assert_eq!(calls.len(), 3);
    for request in calls {
        assert_eq!(request.body["model"], "local-model", "never claude-…");
        // The server does not say its context: the documented default.
        assert_eq!(request.body["max_tokens"], 2048);
    }
    assert_eq!(requests[0].header("x-api-key"), None, "no key was set");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_key_in_the_base_url_is_never_printed() {
    use markov_testkit::http::{FakeServer, Reply, openai};

    const SECRET: &str = "sk-demo-secret";
    let server = FakeServer::start().await;
    openai::serve_without_context(&server, "m");
    server.reply(Reply::json(
        400,
        openai::error("invalid_request_error", "no such model"),
    ));
    let base = format!("{}/v1?api-key={SECRET}", server.base_url());
    let output =
        demo_off_runtime(&[("OPENAI_BASE_URL", base.as_str()), ("MARKOV_MODEL", "m")]).await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stdout}\n{stderr}");
    let first = stdout.lines().next().unwrap_or_default();
    assert!(
        first.starts_with(&format!(
            "model: openai chat completions api ({}/v1/chat/completions?redacted, m)",
            server.base_url()
        )),
        "{first}"
    );
    // The error names the URL it came from, redacted the same way.
    assert!(stderr.contains("no such model"), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "(from {}/v1/chat/completions?redacted)",
            server.base_url()
        )),
        "{stderr}"
    );
    assert!(!stdout.contains(SECRET), "{stdout}");
    assert!(!stderr.contains(SECRET), "{stderr}");
    let paths: Vec<String> = server.requests().into_iter().map(|r| r.path).collect();
    assert_eq!(
        paths,
        [
            format!("/v1/models?api-key={SECRET}"),
            format!("/props?api-key={SECRET}"),
            format!("/v1/chat/completions?api-key={SECRET}"),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_local_server_that_serves_several_models_wants_one_named() {
    use markov_testkit::http::{FakeServer, Reply};
    use serde_json::json;

    let server = FakeServer::scripted(vec![Reply::json(
        200,
        json!({"object": "list", "data": [{"id": "qwen3"}, {"id": "llama3.2"}]}),
    )])
    .await;
    let base = format!("{}/v1", server.base_url());
    let output = demo_off_runtime(&[("OPENAI_BASE_URL", base.as_str())]).await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stderr.contains("set MARKOV_MODEL"), "{stderr}");
    assert!(stderr.contains("qwen3, llama3.2"), "{stderr}");
    assert_eq!(server.single().path, "/v1/models", "no model call was made");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_model_that_answers_in_text_is_reported_not_believed() {
    use markov_testkit::http::{FakeServer, Reply, openai};

    // A server without a tool-capable chat template answers the forced
    // first call with a confident text.
    let server = FakeServer::scripted(vec![Reply::json(
        200,
        openai::text("Lisbon and Porto have 3 million people together."),
    )])
    .await;
    openai::serve_without_context(&server, "m");
    let base = format!("{}/v1", server.base_url());
    let output =
        demo_off_runtime(&[("OPENAI_BASE_URL", base.as_str()), ("MARKOV_MODEL", "m")]).await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stdout}\n{stderr}");
    // Nothing says the server dropped the tools: the model chose text,
    // which llama-server lets through.
    assert!(
        stderr.contains("answered in text although the call required a tool call"),
        "{stderr}"
    );
    assert!(
        stderr.contains("does not enforce a required tool choice"),
        "{stderr}"
    );
    assert!(!stderr.contains("does not pass the tools"), "{stderr}");
    // Should the model never have seen them, the way out is named.
    assert!(stderr.contains("--jinja"), "{stderr}");
    assert!(stderr.contains("--chat-template-file"), "{stderr}");
    assert!(!stdout.contains("3 million"), "{stdout}");
    let calls: Vec<_> = server
        .requests()
        .into_iter()
        .filter(|r| r.method == "POST")
        .collect();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].body["tool_choice"], "required");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn the_responses_api_is_picked_and_named_on_the_first_line() {
    use markov_testkit::http::{FakeServer, Reply, openai, responses};
    use serde_json::json;

    let server = FakeServer::scripted(vec![
        Reply::json(
            200,
            responses::response(
                "1",
                vec![
                    responses::function_call_item("c1", "population", &json!({"city": "Lisbon"})),
                    responses::function_call_item("c2", "population", &json!({"city": "Porto"})),
                ],
            ),
        ),
        Reply::json(
            200,
            responses::function_call("c3", "add", &json!({"a": 545_923, "b": 231_962})),
        ),
        Reply::json(
            200,
            responses::text("777885 people, said the Responses API."),
        ),
    ])
    .await;
    openai::serve_without_context(&server, "local-model");
    let base = format!("{}/v1", server.base_url());
    let output = demo_off_runtime(&[
        ("OPENAI_BASE_URL", base.as_str()),
        ("MARKOV_OPENAI_API", "responses"),
        ("MARKOV_MODEL", "local-model"),
    ])
    .await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert_eq!(
        stdout.lines().next().unwrap_or_default(),
        format!(
            "model: openai responses api ({}/v1/responses, local-model)",
            server.base_url()
        )
    );
    assert!(stdout.contains("said the Responses API."), "{stdout}");
    let requests: Vec<_> = server
        .requests()
        .into_iter()
        .filter(|r| r.method == "POST")
        .collect();
    assert_eq!(requests.len(), 3);
    assert!(requests.iter().all(|r| r.path == "/v1/responses"));
}

#[test]
fn an_unknown_openai_api_is_named() {
    let output = demo(&[
        ("OPENAI_BASE_URL", "http://127.0.0.1:9/v1"),
        ("MARKOV_OPENAI_API", "assistants"),
    ]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(r#"MARKOV_OPENAI_API is "assistants"; expected `responses` or `chat`"#),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn gemini_is_picked_and_named_on_the_first_line() {
    use markov_testkit::http::{FakeServer, Reply, gemini};
    use serde_json::json;

    let server = FakeServer::scripted(vec![
        Reply::json(
            200,
            gemini::response(
                vec![
                    gemini::function_call_part(
                        "population",
                        &json!({"city": "Lisbon"}),
                        Some("s1"),
                    ),
                    gemini::function_call_part("population", &json!({"city": "Porto"}), None),
                ],
                "STOP",
            ),
        ),
        Reply::json(
            200,
            gemini::function_call("add", &json!({"a": 545_923, "b": 231_962})),
        ),
        Reply::json(200, gemini::text("777885 people, said Gemini.")),
    ])
    .await;
    let base = server.base_url();
    let output = demo_off_runtime(&[
        ("GEMINI_BASE_URL", base.as_str()),
        ("MARKOV_MODEL", "gemini-local"),
    ])
    .await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert_eq!(
        stdout.lines().next().unwrap_or_default(),
        format!(
            "model: gemini api ({}/v1beta/models/gemini-local:generateContent, gemini-local)",
            server.base_url()
        )
    );
    assert!(stdout.contains("said Gemini."), "{stdout}");
    let requests = server.requests();
    assert_eq!(requests.len(), 3);
    assert_eq!(
        requests[0].body["toolConfig"]["functionCallingConfig"]["mode"], "ANY",
        "the demo's first call must use a tool"
    );
}

/// Runs the demo against `server`'s Chat Completions API with
/// `MARKOV_MODEL=m` and returns the `max_completion_tokens` of its first
/// model call and the demo's output.
async fn first_budget(server: &markov_testkit::http::FakeServer) -> (serde_json::Value, Output) {
    let base = format!("{}/v1", server.base_url());
    let output =
        demo_off_runtime(&[("OPENAI_BASE_URL", base.as_str()), ("MARKOV_MODEL", "m")]).await;
    let call = server
        .requests()
        .into_iter()
        .find(|r| r.method == "POST")
        .expect("a model call");
    (call.body["max_completion_tokens"].clone(), output)
}

/// The demo's four model calls on the Chat Completions API.
fn the_demo_answers(server: &markov_testkit::http::FakeServer) {
    use markov_testkit::http::{Reply, openai};
    use serde_json::json;
    server
        .reply(Reply::json(
            200,
            openai::tool_call("c1", "population", &json!({"city": "Lisbon"})),
        ))
        .reply(Reply::json(
            200,
            openai::tool_call("c2", "population", &json!({"city": "Porto"})),
        ))
        .reply(Reply::json(
            200,
            openai::tool_call("c3", "add", &json!({"a": 545_923, "b": 231_962})),
        ))
        .reply(Reply::json(200, openai::text("777885 people.")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn the_answer_fits_the_context_a_llama_cpp_server_reports() {
    use markov_testkit::http::{FakeServer, openai};

    // llama-server -c 4096: a quarter of it, never the whole context.
    let server = FakeServer::start().await;
    openai::serve_as_llama_cpp(&server, "m", 4096, false);
    the_demo_answers(&server);
    let (budget, output) = first_budget(&server).await;
    assert!(output.status.success(), "{output:?}");
    assert_eq!(budget, 1024);
    assert_eq!(server.requests()[1].path, "/props", "llama.cpp was asked");

    // A newer build says `n_ctx` at the top level as well.
    let server = FakeServer::start().await;
    openai::serve_as_llama_cpp(&server, "m", 8192, true);
    the_demo_answers(&server);
    let (budget, output) = first_budget(&server).await;
    assert!(output.status.success(), "{output:?}");
    assert_eq!(budget, 2048);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn the_answer_fits_the_context_a_vllm_server_reports() {
    use markov_testkit::http::{FakeServer, openai};

    let server = FakeServer::start().await;
    openai::serve_as_vllm(&server, "m", 16_384);
    the_demo_answers(&server);
    let (budget, output) = first_budget(&server).await;
    assert!(output.status.success(), "{output:?}");
    assert_eq!(budget, 4096);

    // However large the context, no more than a known model's cap.
    let server = FakeServer::start().await;
    openai::serve_as_vllm(&server, "m", 131_072);
    the_demo_answers(&server);
    let (budget, _) = first_budget(&server).await;
    assert_eq!(budget, 8192);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_server_that_does_not_report_its_context_gets_the_documented_default() {
    use markov_testkit::http::{FakeServer, openai};

    let server = FakeServer::start().await;
    openai::serve_without_context(&server, "m");
    the_demo_answers(&server);
    let (budget, output) = first_budget(&server).await;
    assert!(output.status.success(), "{output:?}");
    assert_eq!(budget, markov_core::model::UNKNOWN_MODEL_MAX_TOKENS);

    // A server that answers nothing about itself (each GET refused):
    // the default too, and the run goes on.
    let server = FakeServer::start().await;
    server.route(
        "GET",
        "/v1/models",
        markov_testkit::http::Reply::text(500, "no"),
    );
    server.route(
        "GET",
        "/props",
        markov_testkit::http::Reply::text(500, "no"),
    );
    the_demo_answers(&server);
    let (budget, output) = first_budget(&server).await;
    assert!(output.status.success(), "{output:?}");
    assert_eq!(budget, markov_core::model::UNKNOWN_MODEL_MAX_TOKENS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_demo_that_ends_without_an_answer_says_why_and_fails() {
    use markov_testkit::http::{FakeServer, Reply, openai};
    use serde_json::json;

    // The first answer calls the tools; then llama-server refuses the
    // conversation as longer than its context.
    let server = FakeServer::start().await;
    openai::serve_as_llama_cpp(&server, "m", 4096, false);
    server
        .reply(Reply::json(
            200,
            openai::tool_call("c1", "population", &json!({"city": "Lisbon"})),
        ))
        .reply(Reply::json(
            400,
            json!({"error": {"code": 400, "message": "the request exceeds the available context size, try increasing it", "type": "exceed_context_size_error", "n_prompt_tokens": 5000, "n_ctx": 4096}}),
        ));
    let (_, output) = first_budget(&server).await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stdout.contains("(context_exhausted):"), "{stdout}");
    assert!(
        stderr.contains("no answer: the conversation no longer fits the model's context window (about 4096 tokens"),
        "{stderr}"
    );
    assert!(stderr.contains("llama-server -c"), "{stderr}");
}

/// Runs the demo against `server` (Chat Completions, `MARKOV_MODEL=m`),
/// whose first answer is the text `answer`; returns its stderr.
async fn refused_text(server: markov_testkit::http::FakeServer, answer: &str) -> String {
    use markov_testkit::http::{Reply, openai};
    server.reply(Reply::json(200, openai::text(answer)));
    let (_, output) = first_budget(&server).await;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(!stdout.contains("3 million"), "{stdout}");
    stderr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_server_whose_template_has_no_tools_is_named_as_the_cause() {
    use markov_testkit::http::{FakeServer, Reply, openai};

    // llama-server with a template that drops the tools (no --jinja, or a
    // model's own template without tools), as its /props shows.
    let server = FakeServer::start().await;
    openai::serve_as_llama_cpp(&server, "m", 4096, false);
    server.route(
        "GET",
        "/props",
        Reply::json(200, openai::llama_cpp_props("m", 4096, "{{ messages }}")),
    );
    let stderr = refused_text(server, "Lisbon and Porto have 3 million people together.").await;
    assert!(
        stderr.contains(
            "the server does not pass the tools to the model: its chat template has none"
        ),
        "{stderr}"
    );
    assert!(stderr.contains("--chat-template-file"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_template_with_tools_leaves_the_choice_to_the_model() {
    use markov_testkit::http::{FakeServer, openai};

    let server = FakeServer::start().await;
    openai::serve_as_llama_cpp(&server, "m", 4096, false);
    let stderr = refused_text(server, "Lisbon and Porto have 3 million people together.").await;
    assert!(
        stderr.contains("answered in text although the call required a tool call"),
        "{stderr}"
    );
    assert!(!stderr.contains("does not pass the tools"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_tool_call_left_in_the_text_is_named_as_the_servers() {
    use markov_testkit::http::{FakeServer, openai};

    // The model called the tool; the server did not parse the call out.
    let server = FakeServer::start().await;
    openai::serve_without_context(&server, "m");
    let stderr = refused_text(
        server,
        r#"<tool_call>
{"name": "population", "arguments": {"city": "Lisbon"}}
</tool_call>"#,
    )
    .await;
    assert!(stderr.contains("returned a tool call as text"), "{stderr}");
    assert!(
        stderr.contains("does not parse tool calls out of the model's output"),
        "{stderr}"
    );
    assert!(stderr.contains("--tool-call-parser"), "{stderr}");
}
