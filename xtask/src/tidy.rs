//! Tidy: workspace conventions and architecture invariants, checked by
//! `cargo test` (rust-analyzer's `xtask/src/tidy.rs`).
//!
//! The [`tidy`] test walks the sources and manifests and reports every
//! violation at once, each with its file. The checks:
//!
//! - every `.rs` file under `crates/*/{src,tests,examples,benches}` and
//!   `xtask/src` starts with a `//!` module doc comment;
//! - no test uses the `should_panic` attribute: assert on the `Result` or
//!   the panic payload instead;
//! - no source cites section numbers of a document outside the repository
//!   (comments speak in prose; `docs/PORTING.md` relates us to upstream);
//! - the layers point one way: each workspace crate (and `xtask`) has a
//!   row in [`LAYERS`] naming the markov crates its `[dependencies]` may
//!   use (an allow-list: `core` <- `policy`, `charter` <- `executor` <-
//!   `store` <- `server`; the leaf crates `tools-std`, `testkit` and
//!   `providers` on core alone; `mcp` on core and policy; `otel` and
//!   `macros` on none), plus the outside crates it must not use (`core`
//!   no tokio, reqwest or hyper; `executor` no database driver; `store`
//!   no HTTP client); a crate without a row fails with a message to add
//!   one;
//! - no crate's top-level modules import each other in a cycle (`use
//!   crate::x` and `crate::x::` edges between the files and folders of its
//!   `src/`, test modules aside), but the crates of [`CYCLES_ALLOWED`],
//!   which still have one;
//! - internal (`markov-*`) dependencies carry both `path` and `version`, so
//!   each crate can be published on its own;
//! - a README code block announced by `<!-- example: NAME -->` is
//!   `crates/markov/examples/NAME.rs` without its `//!` lines, so the code
//!   the README shows is the code CI builds.
//!
//! Manifests are read by a crude line scan (see [`dependencies`]); it knows
//! the forms this workspace uses and keeps this crate dependency-free.
//!
//! Each check is a function of file text, with its own unit test on inline
//! samples, so each demonstrably fails when it should.

use std::fs;
use std::path::{Path, PathBuf};

/// Checks the whole workspace and fails with every violation found.
#[test]
fn tidy() {
    let root = crate::workspace_root().expect("workspace root");
    let mut violations = Vec::new();
    check_sources(&root, &mut violations);
    check_manifests(&root, &mut violations);
    check_module_cycles(&root, &mut violations);
    check_readme_examples(&root, &mut violations);
    check_code_map(&root, &mut violations);
    check_docs(&root, &mut violations);
    assert!(
        violations.is_empty(),
        "tidy found {} problem(s):\n  {}\n",
        violations.len(),
        violations.join("\n  ")
    );
}

// ---------------------------------------------------------------------------
// docs/ARCHITECTURE.md's code map.

/// Every crate under `crates/` has a section of its own in the code map,
/// so a new crate cannot land undescribed.
fn check_code_map(root: &Path, violations: &mut Vec<String>) {
    let architecture = match fs::read_to_string(root.join("docs").join("ARCHITECTURE.md")) {
        Ok(text) => text,
        Err(err) => {
            violations.push(format!("docs/ARCHITECTURE.md: cannot read: {err}"));
            return;
        }
    };
    for dir in crate_dirs(root, violations) {
        let shown = relative(root, &dir);
        violations.extend(missing_code_map_section(&architecture, &shown));
    }
}

/// The violation when `architecture` has no `### \`<dir>\`` heading.
fn missing_code_map_section(architecture: &str, dir: &str) -> Option<String> {
    let heading = format!("### `{dir}`");
    let present = architecture.lines().any(|line| line.trim_end() == heading);
    (!present).then(|| {
        format!("docs/ARCHITECTURE.md: no code map section for {dir} (a line `{heading}`)")
    })
}

// ---------------------------------------------------------------------------
// The README and the guide.

/// The most lines the README may have: what markov is, the set-up, the
/// quickstart and links; the manual is the guide.
const README_MAX_LINES: usize = 200;

/// The README stays short, every guide page is linked from the guide's
/// index, the facade doc-tests every page with Rust in it, and every
/// `crates/...` path the README, the guide and `docs/*.md` name exists
/// (but in a `*-HISTORY.md`).
fn check_docs(root: &Path, violations: &mut Vec<String>) {
    let read = |path: &str, violations: &mut Vec<String>| match fs::read_to_string(root.join(path))
    {
        Ok(text) => Some(text),
        Err(err) => {
            violations.push(format!("{path}: cannot read: {err}"));
            None
        }
    };
    if let Some(readme) = read("README.md", violations) {
        violations.extend(check_readme_length(&readme));
    }
    let pages = match crate::readme::documents(root) {
        Ok(pages) => pages,
        Err(err) => return violations.push(err),
    };
    let index = read("docs/guide/README.md", violations).unwrap_or_default();
    let facade = read("crates/markov/src/lib.rs", violations).unwrap_or_default();
    for page in pages.iter().filter(|p| p.starts_with("docs/guide/")) {
        let Some(text) = read(page, violations) else {
            continue;
        };
        let name = page.trim_start_matches("docs/guide/");
        if name != "README.md" {
            violations.extend(check_linked_from_index(&index, name));
        }
        violations.extend(check_doc_tested(&facade, page, &text));
    }
    let mut docs = vec!["README.md".to_owned()];
    docs.extend(pages.into_iter().filter(|p| p != "README.md"));
    for entry in read_dir_sorted(&root.join("docs"), root, violations) {
        // A history names the files of its time.
        let history = entry.to_string_lossy().ends_with("-HISTORY.md");
        if entry.extension().is_some_and(|ext| ext == "md") && !history {
            docs.push(relative(root, &entry));
        }
    }
    for doc in docs {
        if let Some(text) = read(&doc, violations) {
            for path in named_crate_paths(&text) {
                if !root.join(&path).exists() {
                    violations.push(format!("{doc}: names `{path}`, which does not exist"));
                }
            }
        }
    }
}

/// The violation when the README is longer than [`README_MAX_LINES`].
fn check_readme_length(readme: &str) -> Option<String> {
    let lines = readme.lines().count();
    (lines > README_MAX_LINES).then(|| {
        format!(
            "README.md: {lines} lines, more than {README_MAX_LINES}: move the manual to a page of docs/guide/"
        )
    })
}

/// The violation when the guide's index has no link to `page`.
fn check_linked_from_index(index: &str, page: &str) -> Option<String> {
    let link = format!("]({page})");
    let anchored = format!("]({page}#");
    (!index.contains(&link) && !index.contains(&anchored)).then(|| {
        format!("docs/guide/{page}: not linked from the guide's index, docs/guide/README.md")
    })
}

/// The violation when `page` has a Rust block that rustdoc builds but the
/// facade does not include the page as a doc test.
fn check_doc_tested(facade: &str, page: &str, text: &str) -> Option<String> {
    let has_rust = text.lines().any(|line| {
        line.strip_prefix("```").is_some_and(|info| {
            let mut words = info.split(',').map(str::trim);
            words.next() == Some("rust") && !words.any(|word| word == "ignore")
        })
    });
    let include = format!("include_str!(\"../../../{page}\")");
    (has_rust && !facade.contains(&include)).then(|| {
        format!("{page}: has Rust examples, but crates/markov/src/lib.rs does not doc-test it ({include})")
    })
}

/// The `crates/...` paths `text` names: a run of path characters after
/// `crates/`, without trailing punctuation; paths with a placeholder
/// (`*`, `<name>`, `{..}`) are left out.
fn named_crate_paths(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("crates/") {
        let before = rest[..at].chars().next_back();
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || "/._-*<>{}".contains(c)))
            .unwrap_or(tail.len());
        let path = tail[..end].trim_end_matches(['.', '/']);
        rest = &tail[end..];
        let placeholder = path.contains(['*', '<', '>', '{', '}']);
        // `../shared/crates/x` or `markov/crates/x` are not this repository's.
        let inside = !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '/' || c == '.');
        if inside
            && !placeholder
            && path.len() > "crates/".len()
            && !found.iter().any(|f| f == path)
        {
            found.push(path.to_owned());
        }
    }
    found
}

// ---------------------------------------------------------------------------
// The README's examples.

/// Compares every block of the README and the guide announced as an
/// example with its file.
fn check_readme_examples(root: &Path, violations: &mut Vec<String>) {
    let documents = match crate::readme::documents(root) {
        Ok(documents) => documents,
        Err(err) => return violations.push(err),
    };
    for document in documents {
        let text = match fs::read_to_string(root.join(&document)) {
            Ok(text) => text,
            Err(err) => {
                violations.push(format!("{document}: {err}"));
                continue;
            }
        };
        for (name, block) in announced_examples(&text) {
            let path = format!("crates/markov/examples/{name}.rs");
            match fs::read_to_string(root.join(&path)) {
                Ok(file) => {
                    if let Some(problem) = check_example_block(&name, &block, &file) {
                        violations.push(format!("{document}: {problem}"));
                    }
                }
                Err(err) => violations.push(format!("{document}: example {name}: {path}: {err}")),
            }
        }
    }
}

/// Each `<!-- example: NAME -->` marker with the fenced block that follows it.
fn announced_examples(readme: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut lines = readme.lines();
    while let Some(line) = lines.next() {
        let Some(name) = line
            .trim()
            .strip_prefix("<!-- example:")
            .and_then(|rest| rest.strip_suffix("-->"))
        else {
            continue;
        };
        let mut block = String::new();
        let mut inside = false;
        for line in lines.by_ref() {
            if line.starts_with("```") {
                if inside {
                    break;
                }
                inside = true;
                continue;
            }
            if inside {
                block.push_str(line);
                block.push('\n');
            }
        }
        found.push((name.trim().to_owned(), block));
    }
    found
}

/// `None` when `block` is `file` without its leading `//!` lines.
fn check_example_block(name: &str, block: &str, file: &str) -> Option<String> {
    let body: String = file
        .lines()
        .skip_while(|line| line.starts_with("//!"))
        .map(|line| format!("{line}\n"))
        .collect();
    (body.trim() != block.trim()).then(|| {
        format!(
            "the example block `{name}` differs from crates/markov/examples/{name}.rs \
             (copy the file, without its //! lines, into the page)"
        )
    })
}

// ---------------------------------------------------------------------------
// Walking the workspace.

/// Runs the per-file source checks on every Rust file tidy covers.
fn check_sources(root: &Path, violations: &mut Vec<String>) {
    for path in rust_files(root, violations) {
        let shown = relative(root, &path);
        match fs::read_to_string(&path) {
            Ok(text) => {
                violations.extend(check_module_doc(&shown, &text));
                violations.extend(check_no_should_panic(&shown, &text));
                violations.extend(check_prose_references(&shown, &text));
            }
            Err(err) => violations.push(format!("{shown}: cannot read: {err}")),
        }
    }
}

/// Runs the manifest checks on the root and every `crates/*` manifest.
fn check_manifests(root: &Path, violations: &mut Vec<String>) {
    let root_manifest = root.join("Cargo.toml");
    match fs::read_to_string(&root_manifest) {
        Ok(text) => violations.extend(check_internal_deps_versioned(
            "Cargo.toml",
            &text,
            "workspace.dependencies",
        )),
        Err(err) => violations.push(format!("Cargo.toml: cannot read: {err}")),
    }
    match fs::read_to_string(root.join("xtask").join("Cargo.toml")) {
        Ok(text) => violations.extend(check_layering("xtask/Cargo.toml", &text)),
        Err(err) => violations.push(format!("xtask/Cargo.toml: cannot read: {err}")),
    }
    for dir in crate_dirs(root, violations) {
        let manifest = dir.join("Cargo.toml");
        let shown = relative(root, &manifest);
        let text = match fs::read_to_string(&manifest) {
            Ok(text) => text,
            Err(err) => {
                violations.push(format!("{shown}: cannot read: {err}"));
                continue;
            }
        };
        violations.extend(check_layering(&shown, &text));
        violations.extend(check_internal_deps_versioned(&shown, &text, "dependencies"));
    }
}

/// The directories under `crates/` that hold a `Cargo.toml`, sorted.
fn crate_dirs(root: &Path, violations: &mut Vec<String>) -> Vec<PathBuf> {
    let crates = root.join("crates");
    read_dir_sorted(&crates, root, violations)
        .into_iter()
        .filter(|dir| dir.join("Cargo.toml").is_file())
        .collect()
}

/// The `.rs` files tidy checks: `crates/*/{src,tests,examples,benches}/**`
/// and `xtask/src/**`, sorted.
fn rust_files(root: &Path, violations: &mut Vec<String>) -> Vec<PathBuf> {
    let mut dirs = vec![root.join("xtask").join("src")];
    for krate in crate_dirs(root, violations) {
        for sub in ["src", "tests", "examples", "benches"] {
            dirs.push(krate.join(sub));
        }
    }
    let mut files = Vec::new();
    for dir in dirs {
        if dir.is_dir() {
            collect_rust_files(&dir, root, &mut files, violations);
        }
    }
    files.sort();
    files
}

/// Adds the `.rs` files under `dir`, recursively, to `files`.
fn collect_rust_files(
    dir: &Path,
    root: &Path,
    files: &mut Vec<PathBuf>,
    violations: &mut Vec<String>,
) {
    for path in read_dir_sorted(dir, root, violations) {
        if path.is_dir() {
            collect_rust_files(&path, root, files, violations);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            files.push(path);
        }
    }
}

/// The entries of `dir`, sorted; an unreadable directory is a violation.
fn read_dir_sorted(dir: &Path, root: &Path, violations: &mut Vec<String>) -> Vec<PathBuf> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) => {
            violations.push(format!("{}: cannot list: {err}", relative(root, dir)));
            return Vec::new();
        }
    };
    let mut paths = Vec::new();
    for entry in entries {
        match entry {
            Ok(entry) => paths.push(entry.path()),
            Err(err) => violations.push(format!("{}: cannot list: {err}", relative(root, dir))),
        }
    }
    paths.sort();
    paths
}

/// `path` relative to the workspace root, with `/` separators.
fn relative(root: &Path, path: &Path) -> String {
    let rel = path.strip_prefix(root).unwrap_or(path);
    rel.components()
        .map(|c| c.as_os_str().to_string_lossy())
        .collect::<Vec<_>>()
        .join("/")
}

// ---------------------------------------------------------------------------
// Source checks.

/// The first non-empty line of every Rust file must be a `//!` doc comment.
fn check_module_doc(path: &str, text: &str) -> Option<String> {
    let first = text.lines().map(str::trim).find(|line| !line.is_empty());
    match first {
        Some(line) if line.starts_with("//!") => None,
        Some(_) => Some(format!(
            "{path}: does not start with a `//!` module doc comment"
        )),
        None => Some(format!(
            "{path}: is empty; it needs a `//!` module doc comment"
        )),
    }
}

/// No attribute line may mention `should_panic` (plain or in `cfg_attr`).
///
/// A panicking test says nothing about *which* panic happened; assert on a
/// returned error or use `std::panic::catch_unwind` and check the payload.
fn check_no_should_panic(path: &str, text: &str) -> Vec<String> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| {
            let line = line.trim_start();
            line.starts_with("#[") && line.contains("should_panic")
        })
        .map(|(index, _)| {
            format!(
                "{path}:{}: uses the `should_panic` attribute; assert on the error instead",
                index + 1
            )
        })
        .collect()
}

/// Flags references a reader of the repository cannot follow: section
/// numbers (the section sign, U+00A7) of a document that is not in it. Comments and docs speak in
/// prose; `docs/PORTING.md` alone relates the code to upstream.
fn check_prose_references(path: &str, text: &str) -> Vec<String> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| line.contains('\u{a7}'))
        .map(|(n, _)| {
            format!(
                "{path}:{}: a section number (`\u{a7}`): say it in prose (docs/PORTING.md relates us to upstream)",
                n + 1
            )
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Module cycles.

/// The crates whose top-level modules still import each other in a cycle,
/// each with the modules of its cycles. A crate listed here that has no
/// cycle any more, or other ones, is flagged too, so the list only shrinks.
const CYCLES_ALLOWED: &[(&str, &str)] = &[
    ("crates/bench", "failover, server"),
    ("crates/eval", "expect, judge; report, run"),
    ("crates/executor", "executor, step; machine, run"),
    ("crates/server", "api, openapi"),
];

/// Runs [`module_cycles`] on every crate's `src/`.
fn check_module_cycles(root: &Path, violations: &mut Vec<String>) {
    for dir in crate_dirs(root, violations) {
        let src = dir.join("src");
        if !src.is_dir() {
            continue;
        }
        let shown = relative(root, &dir);
        let mut modules: Vec<(String, String)> = Vec::new();
        let mut crate_root = String::new();
        for path in read_dir_sorted(&src, root, violations) {
            let Some(name) = path.file_stem().map(|n| n.to_string_lossy().into_owned()) else {
                continue;
            };
            let mut files = Vec::new();
            if path.is_dir() {
                collect_rust_files(&path, root, &mut files, violations);
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                files.push(path.clone());
            }
            let mut text = String::new();
            for file in files {
                match fs::read_to_string(&file) {
                    Ok(t) => text.push_str(&t),
                    Err(err) => {
                        violations.push(format!("{}: cannot read: {err}", relative(root, &file)))
                    }
                }
                text.push('\n');
            }
            if name == "lib" || name == "main" {
                crate_root.push_str(&text);
            } else if !text.is_empty() {
                modules.push((name, text));
            }
        }
        let cycles = module_cycles(&crate_root, &modules);
        let allowed = CYCLES_ALLOWED.iter().find(|(krate, _)| *krate == shown);
        match (allowed, cycles.is_empty()) {
            (None, false) => violations.push(format!(
                "{shown}/src: modules import each other in a cycle ({}): let the data and state types import no stage, and the stages import them",
                describe_cycles(&cycles)
            )),
            (Some((_, listed)), false) if *listed != describe_cycles(&cycles) => violations.push(format!(
                "{shown}/src: its module cycles are now {}, not the {listed} CYCLES_ALLOWED lists: break the new ones, or update the list if some went",
                describe_cycles(&cycles)
            )),
            (Some(_), true) => violations.push(format!(
                "{shown}/src: has no module cycle any more: take it off CYCLES_ALLOWED"
            )),
            _ => {}
        }
    }
}

/// `a, b; c, d` for the cycles `[a, b]` and `[c, d]`.
fn describe_cycles(cycles: &[Vec<String>]) -> String {
    cycles
        .iter()
        .map(|cycle| cycle.join(", "))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The cycles among a crate's top-level modules, each sorted, in order:
/// the strongly connected components of more than one module of the graph
/// in which a module points at every module its production code names as
/// `crate::x` (also in `use crate::{x, y::Z}` groups, and through a name
/// the crate root re-exports, `pub use x::Z`). `modules` are the modules'
/// names and source texts; `crate_root` is `lib.rs`'s (or `main.rs`'s).
fn module_cycles(crate_root: &str, modules: &[(String, String)]) -> Vec<Vec<String>> {
    let index = |name: &str| modules.iter().position(|(m, _)| m == name);
    let reexported = reexports(crate_root);
    let target = |name: &str| {
        index(name).or_else(|| {
            reexported
                .iter()
                .find(|(item, _)| item == name)
                .and_then(|(_, module)| index(module))
        })
    };
    let edges: Vec<Vec<usize>> = modules
        .iter()
        .enumerate()
        .map(|(at, (_, text))| {
            let mut out: Vec<usize> = crate_paths(&production_code(text))
                .iter()
                .filter_map(|name| target(name))
                .filter(|&to| to != at)
                .collect();
            out.sort_unstable();
            out.dedup();
            out
        })
        .collect();
    let mut cycles: Vec<Vec<String>> = strongly_connected(&edges)
        .into_iter()
        .filter(|component| component.len() > 1)
        .map(|component| {
            let mut names: Vec<String> = component.iter().map(|&i| modules[i].0.clone()).collect();
            names.sort();
            names
        })
        .collect();
    cycles.sort();
    cycles
}

/// The source without comment lines and without its test module (from a
/// `#[cfg(test)]` line followed by an inline `mod … {`).
fn production_code(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = String::new();
    let mut skipping = false;
    for (n, line) in lines.iter().enumerate() {
        let trimmed = line.trim();
        let next = lines.get(n + 1).map_or("", |l| l.trim());
        if trimmed == "#[cfg(test)]" && next.starts_with("mod ") && next.ends_with('{') {
            // A file's test module is its last item: skip to the next file
            // of a folder (each starts with its `//!` doc).
            skipping = true;
        } else if skipping && trimmed.starts_with("//!") {
            skipping = false;
        }
        if !skipping && !trimmed.starts_with("//") {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The first segment of every `crate::` path in `code`, including each
/// path of a `crate::{..}` group.
fn crate_paths(code: &str) -> Vec<String> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut names = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // `markov_crate::`, not this crate
        }
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0usize;
            let mut start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => start = true,
                    c if start && !c.is_whitespace() => {
                        start = false;
                        names.push(ident(&group[i..]));
                    }
                    _ => {}
                }
            }
        } else {
            names.push(ident(rest));
        }
    }
    names.retain(|n| !n.is_empty());
    names
}

/// The names the crate root re-exports, each with the module it comes
/// from: `pub use x::{A, B};` and `pub use x::A;`.
fn reexports(crate_root: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for statement in crate_root.split(';') {
        let Some((_, path)) = statement.split_once("pub use ") else {
            continue;
        };
        let path = path.trim().trim_start_matches("crate::");
        let Some((module, items)) = path.split_once("::") else {
            continue;
        };
        let items = items.trim().trim_start_matches('{').trim_end_matches('}');
        for item in items.split(',') {
            let name = item.rsplit("::").next().unwrap_or("").trim();
            let name = name.rsplit(" as ").next().unwrap_or(name).trim();
            if !name.is_empty() {
                out.push((name.to_owned(), module.trim().to_owned()));
            }
        }
    }
    out
}

/// Tarjan's strongly connected components of the graph `edges` (node `i`
/// points at `edges[i]`).
fn strongly_connected(edges: &[Vec<usize>]) -> Vec<Vec<usize>> {
    struct Walk<'a> {
        edges: &'a [Vec<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(w: &mut Walk<'_>, v: usize) {
        w.index[v] = Some(w.next);
        w.low[v] = w.next;
        w.next += 1;
        w.stack.push(v);
        w.on_stack[v] = true;
        for &to in &w.edges[v] {
            match w.index[to] {
                None => {
                    visit(w, to);
                    w.low[v] = w.low[v].min(w.low[to]);
                }
                Some(i) if w.on_stack[to] => w.low[v] = w.low[v].min(i),
                Some(_) => {}
            }
        }
        if Some(w.low[v]) == w.index[v] {
            let mut component = Vec::new();
            while let Some(top) = w.stack.pop() {
                w.on_stack[top] = false;
                component.push(top);
                if top == v {
                    break;
                }
            }
            w.out.push(component);
        }
    }
    let n = edges.len();
    let mut walk = Walk {
        edges,
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if walk.index[v].is_none() {
            visit(&mut walk, v);
        }
    }
    walk.out
}

// ---------------------------------------------------------------------------
// Manifest checks.

/// A layering rule: the markov crates `package` may depend on, and why.
///
/// An allow-list: a `markov-*` dependency in `[dependencies]` that its row
/// does not name is a violation, and so is a crate with no row.
/// `[dev-dependencies]` are not checked (a crate's tests may run it under
/// the loop and the testkit above it). `forbidden` names the outside
/// crates the layer must not use either.
#[derive(Debug)]
struct Layer {
    package: &'static str,
    /// The `markov-*` crates its `[dependencies]` may name.
    allowed: &'static [&'static str],
    /// Outside crates it must not depend on.
    forbidden: &'static [&'static str],
    reason: &'static str,
}

/// The architecture's dependency rules, one row per workspace crate. A
/// row may name a crate that does not exist yet; a crate without a row
/// fails tidy.
const LAYERS: &[Layer] = &[
    Layer {
        package: "markov-macros",
        allowed: &[],
        forbidden: &[],
        reason: "a proc-macro crate writes code; it links no markov crate",
    },
    Layer {
        package: "markov-core",
        // The `#[tool]` attribute under its `macros` feature: a proc-macro
        // crate that links no markov crate.
        allowed: &["markov-macros"],
        forbidden: &["tokio", "reqwest", "hyper"],
        reason: "core does no I/O and is the bottom layer",
    },
    Layer {
        package: "markov-policy",
        allowed: &["markov-core"],
        forbidden: &[],
        reason: "the tool registry depends on core only",
    },
    Layer {
        package: "markov-charter",
        allowed: &["markov-core"],
        forbidden: &[],
        reason: "the definitions depend on core only; running them is the executor's",
    },
    Layer {
        package: "markov-context",
        allowed: &["markov-core", "markov-charter"],
        forbidden: &[],
        reason: "context views, usage, limits and prices build on the definitions",
    },
    Layer {
        package: "markov-restate",
        allowed: &[
            "markov-core",
            "markov-charter",
            "markov-policy",
            "markov-executor",
        ],
        forbidden: &[],
        reason: "the Restate adapter drives the executor's loop; only the facade and the cli may build on it",
    },
    Layer {
        package: "markov-temporal",
        allowed: &[
            "markov-core",
            "markov-charter",
            "markov-policy",
            "markov-executor",
        ],
        forbidden: &[],
        reason: "the Temporal adapter drives the executor's loop; only the cli may build on it",
    },
    Layer {
        package: "markov-guard",
        allowed: &["markov-core"],
        forbidden: &["tokio", "reqwest", "hyper"],
        reason: "guards are checks on text, on core alone; the executor runs them",
    },
    Layer {
        package: "markov-executor",
        allowed: &[
            "markov-core",
            "markov-guard",
            "markov-policy",
            "markov-charter",
            "markov-context",
        ],
        forbidden: &["rusqlite", "tokio-postgres"],
        reason: "the executor knows no database and no vendor; the store builds on it",
    },
    Layer {
        package: "markov-tools-std",
        allowed: &["markov-core"],
        forbidden: &[],
        reason: "tool crates depend on core only",
    },
    Layer {
        package: "markov-testkit",
        allowed: &["markov-core"],
        forbidden: &[],
        reason: "testkit depends on core only",
    },
    Layer {
        package: "markov-providers",
        allowed: &["markov-core"],
        forbidden: &[],
        reason: "model providers depend on core only",
    },
    Layer {
        package: "markov-otel",
        allowed: &[],
        forbidden: &[],
        reason: "the OpenTelemetry bridge works on tracing spans alone",
    },
    Layer {
        package: "markov-mcp",
        allowed: &["markov-core", "markov-policy"],
        forbidden: &[],
        reason: "MCP tools are tools: markov-mcp builds on core and policy only",
    },
    Layer {
        package: "markov-store",
        allowed: &[
            "markov-core",
            "markov-policy",
            "markov-charter",
            "markov-context",
            "markov-executor",
        ],
        forbidden: &["reqwest"],
        reason: "the store persists machines; it knows no model vendor",
    },
    Layer {
        package: "markov-server",
        allowed: &[
            "markov-core",
            "markov-policy",
            "markov-charter",
            "markov-context",
            "markov-executor",
            "markov-store",
        ],
        forbidden: &[],
        reason: "the server serves any agent on any model from a store",
    },
    Layer {
        package: "markov-eval",
        allowed: &[
            "markov-core",
            "markov-policy",
            "markov-charter",
            "markov-context",
            "markov-executor",
            "markov-store",
            "markov-providers",
            "markov-testkit",
        ],
        forbidden: &[],
        reason: "evals run any agent; the demo's eval binary builds on them, not they on it",
    },
    Layer {
        package: "markov-cli",
        allowed: &[
            "markov-core",
            "markov-policy",
            "markov-charter",
            "markov-context",
            "markov-executor",
            "markov-store",
            "markov-server",
            "markov-providers",
            "markov-mcp",
            "markov-eval",
            "markov-testkit",
            "markov-tools-std",
        ],
        forbidden: &[],
        reason: "the demo binaries use the crates, never the facade or the benchmarks",
    },
    Layer {
        package: "markov-bench",
        allowed: &[
            "markov-core",
            "markov-policy",
            "markov-charter",
            "markov-context",
            "markov-executor",
            "markov-guard",
            "markov-store",
            "markov-server",
            "markov-providers",
            "markov-mcp",
            "markov-testkit",
        ],
        forbidden: &[],
        reason: "the benchmarks measure the crates, never the facade or the demo",
    },
    Layer {
        package: "xtask",
        allowed: &[],
        forbidden: &[],
        reason: "the build tasks build the crates; they link none",
    },
    Layer {
        package: "markov",
        allowed: &[
            "markov-core",
            "markov-macros",
            "markov-policy",
            "markov-charter",
            "markov-context",
            "markov-executor",
            "markov-guard",
            "markov-tools-std",
            "markov-testkit",
            "markov-providers",
            "markov-otel",
            "markov-mcp",
            "markov-store",
            "markov-server",
            "markov-eval",
        ],
        forbidden: &[],
        reason: "the facade re-exports the libraries, not the demo or the benchmarks",
    },
];

/// Edges the layering does not intend that the tree still has, allowed
/// until the crate loses them: `(package, dependency)`.
const TEMPORARY_EDGES: &[(&str, &str)] = &[];

/// Flags the `[dependencies]` of the manifest's package that its row does
/// not allow, and a package with no row.
fn check_layering(path: &str, manifest: &str) -> Vec<String> {
    let Some(package) = package_name(manifest) else {
        return vec![format!("{path}: no `name` in `[package]`")];
    };
    let Some(layer) = LAYERS.iter().find(|layer| layer.package == package) else {
        return vec![format!(
            "{path}: `{package}` has no row in LAYERS (xtask/src/tidy.rs): add one that names the markov crates it may depend on"
        )];
    };
    dependencies(manifest, "dependencies")
        .into_iter()
        .filter_map(|dep| {
            let name = dep.crate_name();
            let refused = if name.starts_with("markov") {
                !layer.allowed.contains(&name)
                    && !TEMPORARY_EDGES.contains(&(package.as_str(), name))
            } else {
                layer.forbidden.contains(&name)
            };
            refused.then(|| {
                format!(
                    "{path}:{}: `{package}` must not depend on `{name}` ({})",
                    dep.line, layer.reason
                )
            })
        })
        .collect()
}

/// Flags `markov-*` dependencies in `section` that lack `path` or `version`.
///
/// A dependency inherited with `workspace = true` gets both from the root's
/// `[workspace.dependencies]`, which this same check covers.
fn check_internal_deps_versioned(path: &str, manifest: &str, section: &str) -> Vec<String> {
    dependencies(manifest, section)
        .into_iter()
        .filter(|dep| dep.crate_name().starts_with("markov-"))
        .filter(|dep| !dep.has_key("workspace"))
        .filter(|dep| !(dep.has_key("path") && dep.has_key("version")))
        .map(|dep| {
            format!(
                "{path}:{}: internal dependency `{}` in `[{section}]` needs both `path` and `version`",
                dep.line, dep.name
            )
        })
        .collect()
}

// ---------------------------------------------------------------------------
// A crude manifest scanner.

/// One dependency as declared in a manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Dep {
    /// The key it is declared under.
    name: String,
    /// The `package = ".."` it renames, if any.
    package: Option<String>,
    /// The keys given for it: `version`, `path`, `workspace`, `features`...
    /// A bare version string (`foo = "1"`) counts as `version`.
    keys: Vec<String>,
    /// The 1-based line of its declaration.
    line: usize,
}

impl Dep {
    /// The crate it resolves to: `package` if renamed, else its key.
    fn crate_name(&self) -> &str {
        self.package.as_deref().unwrap_or(&self.name)
    }

    fn has_key(&self, key: &str) -> bool {
        self.keys.iter().any(|k| k == key)
    }
}

/// The `name` in the manifest's `[package]` section.
fn package_name(manifest: &str) -> Option<String> {
    let mut in_package = false;
    for line in manifest.lines().map(strip_comment) {
        if let Some(header) = section_header(line) {
            in_package = header == "package";
        } else if in_package
            && let Some((key, value)) = line.split_once('=')
            && key.trim() == "name"
        {
            return Some(unquote(value.trim()).to_owned());
        }
    }
    None
}

/// The dependencies declared in `section` (`dependencies` or
/// `workspace.dependencies`), in both inline (`[dependencies]` then
/// `foo = { .. }`) and table (`[dependencies.foo]`) form. For
/// `dependencies`, target-specific tables
/// (`[target.'cfg(unix)'.dependencies]`) count too.
///
/// This is a line scan, not a TOML parser: it expects one dependency per
/// line, which is what `cargo fmt`-era manifests (and ours) use.
fn dependencies(manifest: &str, section: &str) -> Vec<Dep> {
    /// Where the scanner is.
    enum State {
        Elsewhere,
        /// In `[section]`: each `key = value` line is a dependency.
        Inline,
        /// In `[section.name]`: each line is a key of `deps[index]`.
        Table(usize),
    }

    let mut deps: Vec<Dep> = Vec::new();
    let mut state = State::Elsewhere;
    for (index, raw) in manifest.lines().enumerate() {
        let line = strip_comment(raw);
        let line_no = index + 1;
        if let Some(header) = section_header(line) {
            let header = without_target(header);
            state = if header == section {
                State::Inline
            } else if let Some(name) = header
                .strip_prefix(section)
                .and_then(|rest| rest.strip_prefix('.'))
            {
                deps.push(Dep {
                    name: unquote(name).to_owned(),
                    package: None,
                    keys: Vec::new(),
                    line: line_no,
                });
                State::Table(deps.len() - 1)
            } else {
                State::Elsewhere
            };
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        let (key, value) = (key.trim(), value.trim());
        match state {
            State::Elsewhere => {}
            State::Inline => deps.push(inline_dep(key, value, line_no)),
            State::Table(at) => {
                if let Some(dep) = deps.get_mut(at) {
                    if key == "package" {
                        dep.package = Some(unquote(value).to_owned());
                    }
                    dep.keys.push(key.to_owned());
                }
            }
        }
    }
    deps
}

/// Reads `name = "1"`, `name.workspace = true` or `name = { k = v, .. }`.
fn inline_dep(key: &str, value: &str, line: usize) -> Dep {
    let (name, dotted) = match key.split_once('.') {
        Some((name, rest)) => (name.trim(), Some(rest.trim())),
        None => (key, None),
    };
    let mut dep = Dep {
        name: unquote(name).to_owned(),
        package: None,
        keys: Vec::new(),
        line,
    };
    if let Some(dotted) = dotted {
        if dotted == "package" {
            dep.package = Some(unquote(value).to_owned());
        }
        dep.keys.push(dotted.to_owned());
    } else if let Some(table) = value.strip_prefix('{') {
        let table = table.strip_suffix('}').unwrap_or(table);
        // Splitting on ',' also splits feature lists; those pieces have no '='.
        for part in table.split(',') {
            if let Some((k, v)) = part.split_once('=') {
                let k = k.trim();
                if k == "package" {
                    dep.package = Some(unquote(v.trim()).to_owned());
                }
                dep.keys.push(k.to_owned());
            }
        }
    } else {
        dep.keys.push("version".to_owned());
    }
    dep
}

/// `Some("a.b")` for a `[a.b]` line; `None` for other lines and for arrays
/// of tables (`[[bin]]`), which end any dependency section all the same.
fn section_header(line: &str) -> Option<&str> {
    let inner = line.strip_prefix('[')?.strip_suffix(']')?;
    Some(inner.trim())
}

/// Strips a `target.<spec>.` prefix, so target-specific dependency tables
/// read like the plain ones. `<spec>` may be quoted and contain dots.
fn without_target(header: &str) -> &str {
    let Some(rest) = header.strip_prefix("target.") else {
        return header;
    };
    let after_spec = match rest.chars().next() {
        Some(quote @ ('\'' | '"')) => rest[1..].find(quote).map(|end| &rest[end + 2..]),
        _ => rest.find('.').map(|dot| &rest[dot..]),
    };
    after_spec
        .and_then(|after| after.strip_prefix('.'))
        .unwrap_or(header)
}

/// The line without a trailing `#` comment (crudely: `#` inside a string
/// also ends the line, which manifests rarely do) and surrounding space.
fn strip_comment(line: &str) -> &str {
    line.split_once('#').map_or(line, |(code, _)| code).trim()
}

/// `"x"` or `'x'` → `x`; anything else unchanged.
fn unquote(value: &str) -> &str {
    for quote in ['"', '\''] {
        if let Some(inner) = value
            .strip_prefix(quote)
            .and_then(|rest| rest.strip_suffix(quote))
        {
            return inner;
        }
    }
    value
}

// ---------------------------------------------------------------------------
// Each check, on samples it must accept and reject.

#[test]
fn readme_examples_must_match_their_files() {
    let readme = "text\n<!-- example: hello -->\n```rust,no_run\nfn main() {}\n```\nmore\n";
    let found = announced_examples(readme);
    assert_eq!(
        found,
        vec![("hello".to_owned(), "fn main() {}\n".to_owned())]
    );
    let file = "//! Says hello.\nfn main() {}\n";
    assert_eq!(check_example_block("hello", &found[0].1, file), None);
    let changed = "//! Says hello.\nfn main() { println!(); }\n";
    assert!(check_example_block("hello", &found[0].1, changed).is_some());
}

#[test]
fn every_crate_needs_a_code_map_section() {
    let doc = "## Code Map\n\n### `crates/core`\n\nThe traits.\n";
    assert_eq!(missing_code_map_section(doc, "crates/core"), None);
    let missing = missing_code_map_section(doc, "crates/otel").expect("flagged");
    assert!(missing.contains("crates/otel"), "{missing}");
}

#[test]
fn module_doc_is_required() {
    assert_eq!(check_module_doc("a.rs", "\n//! Docs.\nfn f() {}\n"), None);
    let missing = check_module_doc("b.rs", "// Not a doc.\n//! Too late.\n");
    assert_eq!(
        missing.as_deref(),
        Some("b.rs: does not start with a `//!` module doc comment")
    );
    let outer = check_module_doc("c.rs", "/// Outer doc.\nfn f() {}\n");
    assert!(outer.is_some());
    assert!(check_module_doc("d.rs", "\n  \n").is_some());
}

#[test]
fn section_numbers_are_flagged() {
    let sample = "//! Commands (spec \u{a7}12).\nfn f() {}\n";
    assert_eq!(check_prose_references("a.rs", sample).len(), 1);
    assert!(check_prose_references("b.rs", "//! Commands.\n").is_empty());
}

#[test]
fn should_panic_is_flagged() {
    let attr = format!("#[{}]", "should_panic");
    let sample = format!("//! Tests.\n#[test]\n{attr}\nfn boom() {{}}\n");
    assert_eq!(
        check_no_should_panic("t.rs", &sample),
        ["t.rs:3: uses the `should_panic` attribute; assert on the error instead"]
    );
    let cfg_attr = format!(
        "//! Tests.\n  #[cfg_attr(test, {}(expected = \"x\"))]\n",
        "should_panic"
    );
    assert_eq!(check_no_should_panic("u.rs", &cfg_attr).len(), 1);
    let prose = "//! Never use should_panic.\nlet s = \"should_panic\";\n";
    assert!(check_no_should_panic("v.rs", prose).is_empty());
}

#[test]
fn core_must_not_depend_on_io_or_markov_crates() {
    let sample = "[package]\nname = \"markov-core\"\n\n[dependencies]\nserde.workspace = true\ntokio = { workspace = true, features = [\"rt\", \"macros\"] }\nhttp-client = { package = \"reqwest\", version = \"0.12\" }\nmarkov-charter.workspace = true\n\n[dev-dependencies]\ntokio = { workspace = true, features = [\"rt\"] }\nhyper = \"1\"\n";
    assert_eq!(
        check_layering("crates/core/Cargo.toml", sample),
        [
            "crates/core/Cargo.toml:6: `markov-core` must not depend on `tokio` (core does no I/O and is the bottom layer)",
            "crates/core/Cargo.toml:7: `markov-core` must not depend on `reqwest` (core does no I/O and is the bottom layer)",
            "crates/core/Cargo.toml:8: `markov-core` must not depend on `markov-charter` (core does no I/O and is the bottom layer)",
        ]
    );
    let clean = "[package]\nname = \"markov-core\"\n[dependencies]\nserde = \"1\"\n[dev-dependencies]\ntokio = \"1\"\n";
    assert!(check_layering("c", clean).is_empty());
    let macros = "[package]\nname = \"markov-core\"\n[dependencies]\nmarkov-macros = { workspace = true, optional = true }\n";
    assert!(check_layering("c", macros).is_empty());
}

#[test]
fn layers_point_one_way() {
    let charter = "[package]\nname = \"markov-charter\"\n[dependencies]\nmarkov-core.workspace = true\n[dependencies.markov-executor]\nworkspace = true\n";
    assert_eq!(
        check_layering("r", charter),
        [
            "r:5: `markov-charter` must not depend on `markov-executor` (the definitions depend on core only; running them is the executor's)"
        ]
    );
    let charter_on_policy =
        "[package]\nname = \"markov-charter\"\n[dependencies]\nmarkov-policy.workspace = true\n";
    assert_eq!(
        check_layering("r", charter_on_policy),
        [
            "r:4: `markov-charter` must not depend on `markov-policy` (the definitions depend on core only; running them is the executor's)"
        ]
    );
    let executor = "[package]\nname = \"markov-executor\"\n[dependencies]\nmarkov-core.workspace = true\nmarkov-charter.workspace = true\n";
    assert!(check_layering("e", executor).is_empty());
    let testkit = "[package]\nname = \"markov-testkit\"\n[dependencies]\nmarkov-core.workspace = true\n[target.'cfg(unix)'.dependencies]\nmarkov-charter.workspace = true\n[dev-dependencies]\nmarkov-executor.workspace = true\n";
    assert_eq!(
        check_layering("t", testkit),
        [
            "t:6: `markov-testkit` must not depend on `markov-charter` (testkit depends on core only)"
        ]
    );
    let store = "[package]\nname = \"markov-store\"\n[dependencies]\nmarkov-executor.workspace = true\nreqwest = \"0.13\"\n";
    assert_eq!(
        check_layering("s", store),
        [
            "s:5: `markov-store` must not depend on `reqwest` (the store persists machines; it knows no model vendor)"
        ]
    );
    let executor_db =
        "[package]\nname = \"markov-executor\"\n[dependencies]\nrusqlite = \"0.42\"\n";
    assert_eq!(check_layering("e", executor_db).len(), 1);
    let providers = "[package]\nname = \"markov-providers\"\n[dependencies]\nmarkov-executor = { path = \"../executor\", version = \"0.1\" }\n";
    assert_eq!(check_layering("p", providers).len(), 1);
    let mcp = "[package]\nname = \"markov-mcp\"\n[dependencies]\nmarkov-policy.workspace = true\nmarkov-executor.workspace = true\n";
    assert_eq!(check_layering("m", mcp).len(), 1);
    let policy =
        "[package]\nname = \"markov-policy\"\n[dependencies]\nmarkov-mcp.workspace = true\n";
    assert_eq!(check_layering("p", policy).len(), 1);
    // Leaf crates reach neither the store, the server nor the policy.
    for leaf in ["markov-tools-std", "markov-testkit", "markov-providers"] {
        for above in ["markov-store", "markov-server", "markov-policy"] {
            let manifest = format!(
                "[package]\nname = \"{leaf}\"\n[dependencies]\nmarkov-core.workspace = true\n{above}.workspace = true\n"
            );
            assert_eq!(check_layering("l", &manifest).len(), 1, "{leaf} on {above}");
        }
    }
    // The server may use the store; the store may not use the server.
    let server = "[package]\nname = \"markov-server\"\n[dependencies]\nmarkov-store.workspace = true\nmarkov-cli.workspace = true\n";
    assert_eq!(
        check_layering("s", server),
        [
            "s:5: `markov-server` must not depend on `markov-cli` (the server serves any agent on any model from a store)"
        ]
    );
    let store =
        "[package]\nname = \"markov-store\"\n[dependencies]\nmarkov-server.workspace = true\n";
    assert_eq!(check_layering("s", store).len(), 1);
    // Dev-dependencies are free.
    let dev = "[package]\nname = \"markov-providers\"\n[dependencies]\nmarkov-core.workspace = true\n[dev-dependencies]\nmarkov-executor.workspace = true\n";
    assert!(check_layering("p", dev).is_empty());
}

#[test]
fn every_crate_needs_a_layering_row() {
    let new = "[package]\nname = \"markov-new\"\n[dependencies]\nmarkov-core.workspace = true\n";
    let problems = check_layering("crates/new/Cargo.toml", new);
    assert_eq!(problems.len(), 1);
    assert!(
        problems[0].contains("`markov-new` has no row in LAYERS"),
        "{problems:?}"
    );
    // A row may come before its crate: markov-context's is there already.
    let context = "[package]\nname = \"markov-context\"\n[dependencies]\nmarkov-core.workspace = true\nmarkov-charter.workspace = true\n";
    assert!(check_layering("c", context).is_empty());
    // Every row names crates that have rows themselves.
    for layer in LAYERS {
        for allowed in layer.allowed {
            assert!(
                LAYERS.iter().any(|row| row.package == *allowed),
                "{} allows {allowed}, which has no row",
                layer.package
            );
        }
    }
}

#[test]
fn internal_deps_need_path_and_version() {
    let sample = "[workspace.dependencies]\nmarkov-core = { path = \"crates/core\", version = \"0.1.0\" }\nmarkov-charter = { path = \"crates/charter\" }\nmarkov-executor = \"0.1.0\"\nserde = \"1\"\n[workspace.dependencies.markov-testkit]\npath = \"crates/testkit\"\n";
    assert_eq!(
        check_internal_deps_versioned("Cargo.toml", sample, "workspace.dependencies"),
        [
            "Cargo.toml:3: internal dependency `markov-charter` in `[workspace.dependencies]` needs both `path` and `version`",
            "Cargo.toml:4: internal dependency `markov-executor` in `[workspace.dependencies]` needs both `path` and `version`",
            "Cargo.toml:6: internal dependency `markov-testkit` in `[workspace.dependencies]` needs both `path` and `version`",
        ]
    );
    let member = "[dependencies]\nmarkov-core.workspace = true\nmarkov-charter = { path = \"../runtime\" }\n[dev-dependencies]\nmarkov-testkit = { path = \"../testkit\" }\n";
    assert_eq!(
        check_internal_deps_versioned("m", member, "dependencies").len(),
        1
    );
}

#[test]
fn scanner_reads_the_forms_we_use() {
    let sample = "[package]\nname = \"x\" # the name\n[dependencies]\na = \"1\"\nb.workspace = true\nc = { version = \"1\", features = [\"x\", \"y\"], default-features = false }\n[dependencies.d]\nversion = \"2\"\npackage = \"dee\"\n[[bin]]\nname = \"tool\"\n";
    assert_eq!(package_name(sample).as_deref(), Some("x"));
    let deps = dependencies(sample, "dependencies");
    let names: Vec<&str> = deps.iter().map(Dep::crate_name).collect();
    assert_eq!(names, ["a", "b", "c", "dee"]);
    assert_eq!(deps[2].keys, ["version", "features", "default-features"]);
    assert_eq!(
        without_target("target.'cfg(target_os = \"linux\")'.dependencies"),
        "dependencies"
    );
    assert_eq!(
        without_target("target.x86_64-unknown-linux-gnu.dependencies.foo"),
        "dependencies.foo"
    );
    assert_eq!(
        without_target("workspace.dependencies"),
        "workspace.dependencies"
    );
}

#[test]
fn the_readme_stays_short() {
    assert_eq!(check_readme_length(&"line\n".repeat(200)), None);
    let long = check_readme_length(&"line\n".repeat(201)).expect("flagged");
    assert!(long.contains("201 lines"), "{long}");
}

#[test]
fn every_guide_page_is_linked_from_the_index() {
    let index = "- [Approvals](approvals.md)\n- [MCP](mcp.md#servers)\n";
    assert_eq!(check_linked_from_index(index, "approvals.md"), None);
    assert_eq!(check_linked_from_index(index, "mcp.md"), None);
    assert!(check_linked_from_index(index, "serving.md").is_some());
}

#[test]
fn guide_pages_with_rust_are_doc_tested() {
    let facade = "#[doc = include_str!(\"../../../docs/guide/approvals.md\")]\n";
    let rust = "text\n```rust\nfn main() {}\n```\n";
    assert_eq!(
        check_doc_tested(facade, "docs/guide/approvals.md", rust),
        None
    );
    assert!(check_doc_tested(facade, "docs/guide/serving.md", rust).is_some());
    let ignored = "```rust,ignore\nlet x = y;\n```\n";
    assert_eq!(
        check_doc_tested(facade, "docs/guide/evals.md", ignored),
        None
    );
}

#[test]
fn named_crate_paths_are_read_from_prose() {
    let text = "See `crates/core/src/tool.rs`, crates/cli/evals/demo.toml. Tests in \
        `crates/*/tests/it/`, `crates/markov/examples/<name>.rs`; the peers in \
        ../shared/crates/x and crates/otel.";
    assert_eq!(
        named_crate_paths(text),
        [
            "crates/core/src/tool.rs",
            "crates/cli/evals/demo.toml",
            "crates/otel"
        ]
    );
}
