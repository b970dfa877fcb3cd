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
//! - `markov-core` does no I/O and is the bottom layer: no tokio, reqwest,
//!   hyper or `markov-*` crate in its `[dependencies]` but the proc-macro
//!   `markov-macros` (its `macros` feature);
//! - the layers point one way, `core` ← `policy` ← `charter` ← `executor` ←
//!   `store`: `policy` (the tool registry) depends on core only;
//!   `charter` depends on neither `executor` nor `store`, `executor` knows
//!   no database driver, no vendor and not `store`, `store` knows no model
//!   vendor, and `tools-std`, `testkit` and `providers` depend on none of
//!   `charter` and `executor`; `mcp` builds on `core` and `policy` only,
//!   and none of `core`, `policy`, `charter` and `executor` depends on it;
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
    check_readme_examples(&root, &mut violations);
    check_code_map(&root, &mut violations);
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
// The README's examples.

/// Compares every README block announced as an example with its file.
fn check_readme_examples(root: &Path, violations: &mut Vec<String>) {
    let readme = match fs::read_to_string(root.join("README.md")) {
        Ok(text) => text,
        Err(err) => return violations.push(format!("README.md: {err}")),
    };
    for (name, block) in announced_examples(&readme) {
        let path = format!("crates/markov/examples/{name}.rs");
        match fs::read_to_string(root.join(&path)) {
            Ok(file) => {
                if let Some(problem) = check_example_block(&name, &block, &file) {
                    violations.push(problem);
                }
            }
            Err(err) => violations.push(format!("README.md: example {name}: {path}: {err}")),
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
            "README.md: the example block `{name}` differs from crates/markov/examples/{name}.rs \
             (copy the file, without its //! lines, into the README)"
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
// Manifest checks.

/// Whether `name` matches `pattern`: a crate name, or a prefix ending in
/// `*` (`markov-*`).
fn matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => name == pattern,
    }
}

/// A layering rule: what `package` must not depend on, and why.
#[derive(Debug)]
struct Layer {
    package: &'static str,
    /// Crate names, or prefixes ending in `*`.
    forbidden: &'static [&'static str],
    /// Crate names that a `forbidden` prefix matches but the layer allows.
    except: &'static [&'static str],
    reason: &'static str,
}

/// The architecture's dependency rules, one per package.
const LAYERS: &[Layer] = &[
    Layer {
        package: "markov-core",
        forbidden: &["tokio", "reqwest", "hyper", "markov-*"],
        // The `#[tool]` attribute under its `macros` feature: a proc-macro
        // crate that links no markov crate.
        except: &["markov-macros"],
        reason: "core does no I/O and is the bottom layer",
    },
    Layer {
        package: "markov-charter",
        forbidden: &[
            "markov-executor",
            "markov-store",
            "markov-mcp",
            "markov-restate",
        ],
        except: &[],
        reason: "the layers are core <- charter <- executor <- store",
    },
    Layer {
        package: "markov-executor",
        forbidden: &[
            "markov-store",
            "markov-providers",
            "markov-mcp",
            "markov-restate",
            "rusqlite",
            "tokio-postgres",
        ],
        except: &[],
        reason: "the executor knows no database and no vendor; the store builds on it",
    },
    Layer {
        package: "markov-store",
        forbidden: &[
            "markov-providers",
            "markov-cli",
            "markov-restate",
            "reqwest",
        ],
        except: &[],
        reason: "the store persists machines; it knows no model vendor",
    },
    Layer {
        package: "markov-policy",
        forbidden: &[
            "markov-charter",
            "markov-executor",
            "markov-store",
            "markov-providers",
            "markov-mcp",
            "markov-restate",
        ],
        except: &[],
        reason: "the tool registry depends on core only",
    },
    Layer {
        package: "markov-mcp",
        forbidden: &[
            "markov-charter",
            "markov-executor",
            "markov-store",
            "markov-providers",
            "markov-server",
            "markov-cli",
            "markov-restate",
        ],
        except: &[],
        reason: "MCP tools are tools: markov-mcp builds on core and policy only",
    },
    Layer {
        package: "markov-eval",
        forbidden: &[
            "markov-server",
            "markov-cli",
            "markov-mcp",
            "markov-restate",
        ],
        except: &[],
        reason: "evals run any agent; the demo's eval binary builds on them, not they on it",
    },
    Layer {
        package: "markov-restate",
        forbidden: &["markov-*"],
        except: &[
            "markov-core",
            "markov-charter",
            "markov-policy",
            "markov-executor",
            "markov-store",
            "markov-testkit",
        ],
        reason: "the Restate adapter drives the executor's loop; only the facade and the cli build on it",
    },
    Layer {
        package: "markov-otel",
        forbidden: &["markov-*"],
        except: &[],
        reason: "the OpenTelemetry bridge works on tracing spans alone",
    },
    Layer {
        package: "markov-macros",
        forbidden: &["markov-*"],
        except: &[],
        reason: "a proc-macro crate writes code; it links no markov crate",
    },
    Layer {
        package: "markov-tools-std",
        forbidden: ABOVE_CORE,
        except: &[],
        reason: "tool crates depend on core only",
    },
    Layer {
        package: "markov-testkit",
        forbidden: ABOVE_CORE,
        except: &[],
        reason: "testkit depends on core only",
    },
    Layer {
        package: "markov-providers",
        forbidden: ABOVE_CORE,
        except: &[],
        reason: "model providers depend on core only",
    },
];

/// The layers a leaf crate (tools, testkit, providers) must not reach.
const ABOVE_CORE: &[&str] = &["markov-charter", "markov-executor", "markov-restate"];

/// Flags `[dependencies]` of the manifest's package that its layer forbids.
fn check_layering(path: &str, manifest: &str) -> Vec<String> {
    let Some(package) = package_name(manifest) else {
        return vec![format!("{path}: no `name` in `[package]`")];
    };
    let Some(layer) = LAYERS.iter().find(|layer| layer.package == package) else {
        return Vec::new();
    };
    dependencies(manifest, "dependencies")
        .into_iter()
        .filter(|dep| {
            layer
                .forbidden
                .iter()
                .any(|pattern| matches(pattern, dep.crate_name()))
                && !layer.except.contains(&dep.crate_name())
        })
        .map(|dep| {
            format!(
                "{path}:{}: `{package}` must not depend on `{}` ({})",
                dep.line,
                dep.crate_name(),
                layer.reason
            )
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
            "r:5: `markov-charter` must not depend on `markov-executor` (the layers are core <- charter <- executor <- store)"
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
