//! The command line in process: a run writes its three reports and its
//! sessions, a regression against the baseline fails the command, and a
//! stored session exports as a case that runs.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use markov_eval::{Dataset, Report};

use crate::fixtures::{INSTRUCTIONS, calculator};

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "markov-eval-cli-{name}-{}",
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

async fn cli(args: &[&dyn AsRef<std::ffi::OsStr>]) -> ExitCode {
    let args: Vec<OsString> = std::iter::once(OsString::from("markov-eval"))
        .chain(args.iter().map(|a| a.as_ref().to_owned()))
        .collect();
    markov_eval::cli::main_with(args, |model| calculator(model, INSTRUCTIONS)).await
}

/// The calculator dataset without its `custom` expectation (the command
/// line registers no evaluator), written to `dir`.
fn plain_dataset(dir: &Path, output: &str) -> PathBuf {
    let mut dataset = crate::fixtures::dataset();
    for case in &mut dataset.cases {
        case.expect
            .retain(|e| !matches!(e, markov_eval::Expect::Custom { .. }));
    }
    dataset.cases[0]
        .expect
        .retain(|e| !matches!(e, markov_eval::Expect::OutputEquals { .. }));
    dataset.cases[0]
        .expect
        .push(markov_eval::Expect::OutputEquals {
            value: output.to_owned(),
        });
    let path = dir.join(format!("calc-{}.toml", output.len()));
    std::fs::write(&path, dataset.to_toml().expect("writes")).expect("written");
    path
}

#[tokio::test]
async fn a_run_writes_its_reports_and_a_regression_fails_the_command() {
    let dir = temp_dir("run");
    let good = plain_dataset(&dir, "{\"sum\":5}");
    let base = dir.join("base");
    let code = cli(&[&"run", &good, &"--model", &"scripted", &"--out", &base]).await;
    assert_eq!(code, ExitCode::SUCCESS);
    let report =
        Report::from_json(&std::fs::read_to_string(base.join("report.json")).expect("json"))
            .expect("reads");
    assert_eq!(report.summary.passed, 3);
    let junit = std::fs::read_to_string(base.join("junit.xml")).expect("junit");
    assert_eq!(junit.matches("<testcase ").count(), 3);
    assert!(base.join("sessions.db").exists());

    // The same agent held to another answer: the first case regresses.
    let strict = plain_dataset(&dir, "{\"sum\": five}");
    let now = dir.join("now");
    let baseline = base.join("report.json");
    let with_baseline = |fail: bool| {
        let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![
            &"run",
            &strict,
            &"--model",
            &"scripted",
            &"--out",
            &now,
            &"--baseline",
            &baseline,
            &"--min-pass-rate",
            &"0.5",
        ];
        if fail {
            args.push(&"--fail-on-regression");
        }
        args.into_iter()
            .map(|a| a.as_ref().to_owned())
            .collect::<Vec<OsString>>()
    };
    let run = |args: Vec<OsString>| async move {
        let all = std::iter::once(OsString::from("markov-eval")).chain(args);
        markov_eval::cli::main_with(all, |model| calculator(model, INSTRUCTIONS)).await
    };
    assert_eq!(
        run(with_baseline(false)).await,
        ExitCode::SUCCESS,
        "2 of 3 pass, above 0.5"
    );
    assert_eq!(
        run(with_baseline(true)).await,
        ExitCode::FAILURE,
        "the regression fails it"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_stored_run_exports_as_a_case_that_replays() {
    let dir = temp_dir("export");
    let good = plain_dataset(&dir, "{\"sum\":5}");
    let out = dir.join("out");
    assert_eq!(
        cli(&[&"run", &good, &"--model", &"scripted", &"--out", &out]).await,
        ExitCode::SUCCESS
    );
    let report =
        Report::from_json(&std::fs::read_to_string(out.join("report.json")).expect("json"))
            .expect("reads");
    let session = report.cases[1].runs[0].session.clone();
    let case_file = dir.join("case.toml");
    let db = out.join("sessions.db");
    assert_eq!(
        cli(&[
            &"export",
            &"--store",
            &db,
            &"--session",
            &session,
            &"--out",
            &case_file
        ])
        .await,
        ExitCode::SUCCESS
    );
    let exported = Dataset::load(&case_file).expect("the export is a dataset");
    assert_eq!(
        exported.cases[0].input,
        ["Add 40 and 2, and report the sum."]
    );
    let replay = dir.join("replay");
    assert_eq!(
        cli(&[
            &"run",
            &case_file,
            &"--model",
            &"scripted",
            &"--out",
            &replay
        ])
        .await,
        ExitCode::SUCCESS
    );
    // The first step's turn alone.
    let range_file = dir.join("range.toml");
    assert_eq!(
        cli(&[
            &"export",
            &"--store",
            &db,
            &"--session",
            &session,
            &"--from",
            &"0",
            &"--to",
            &"1",
            &"--out",
            &range_file
        ])
        .await,
        ExitCode::SUCCESS
    );
    let range = Dataset::load(&range_file).expect("the export is a dataset");
    assert_eq!(range.cases[0].id, format!("{session}-steps-0-1"));
    assert_eq!(range.cases[0].input, exported.cases[0].input);
    // A session that is not there is an error, not a crash.
    assert_eq!(
        cli(&[&"export", &"--store", &db, &"--session", &"nope"]).await,
        ExitCode::from(2)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
