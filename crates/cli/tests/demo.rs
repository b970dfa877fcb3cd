//! Runs the built `markov-demo` binary: with no provider configured it
//! rehearses on the scripted model, says so, and prints the answer; a bad
//! provider configuration is reported plainly with a failing status.

use std::process::{Command, Output};

/// The variables that choose a real provider.
const PROVIDER_VARS: [&str; 3] = ["ANTHROPIC_API_KEY", "OPENAI_API_KEY", "OPENAI_BASE_URL"];

/// Runs the demo with the provider variables removed, then `set` applied.
fn demo(set: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_markov-demo"));
    for var in PROVIDER_VARS {
        command.env_remove(var);
    }
    command.envs(set.iter().copied());
    command.output().expect("the demo binary runs")
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
        "model: scripted (no ANTHROPIC_API_KEY or OPENAI_API_KEY set; \
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
    // The URL itself is redacted (it could carry a key); the reason is shown.
    assert!(stderr.contains("<an unparseable url>"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stdout.is_empty(), "{stdout}");
}
