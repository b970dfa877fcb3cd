//! `cargo xtask readme`: every Rust snippet of the README and of the guide
//! (`docs/guide/*.md`) builds in a fresh crate with the `[dependencies]`
//! block shown beside it, and with nothing else.
//!
//! Each ```rust block (but a `rust,ignore` one, which rustdoc does not
//! build either) must have a ```toml block starting with
//! `[dependencies]` as the fenced block right before it. The snippets that
//! share a block become the bins of one crate under
//! `target/readme-crates/`, its dependencies those of the block with each
//! of the workspace's crates taken from its path instead of the registry
//! (the version stays as the README shows it, and must match). Every crate
//! is built offline with the workspace's lock file, profiles and target
//! directory, so the dependencies the workspace has built are reused. A
//! snippet without `fn main` is wrapped in one, as rustdoc does; lines
//! rustdoc hides (`# ...`) are kept.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::process::Command;

/// One Rust snippet of a document with the dependency block before it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Snippet {
    /// The document, relative to the workspace root (`README.md`).
    pub(crate) file: String,
    /// The line its block starts on (for messages).
    pub(crate) line: usize,
    /// The dependency block (`[dependencies]` and its lines).
    pub(crate) dependencies: String,
    /// The code, as rustdoc compiles it.
    pub(crate) code: String,
}

/// The Rust snippets of `file`, whose text is `readme`, with their
/// dependency blocks, or what is wrong with them.
pub(crate) fn snippets(file: &str, readme: &str) -> Result<Vec<Snippet>, Vec<String>> {
    let mut found = Vec::new();
    let mut problems = Vec::new();
    // The fenced block before the current one: its info string and text.
    let mut previous: Option<(String, String)> = None;
    let mut lines = readme.lines().enumerate();
    while let Some((number, line)) = lines.next() {
        let Some(info) = line.strip_prefix("```") else {
            continue;
        };
        let info = info.trim().to_owned();
        let mut body = String::new();
        for (_, line) in lines.by_ref() {
            if line.starts_with("```") {
                break;
            }
            body.push_str(line);
            body.push('\n');
        }
        let mut words = info.split(',').map(str::trim);
        let language = words.next().unwrap_or_default();
        if language == "rust" && words.any(|word| word == "ignore") {
            continue;
        }
        if language == "rust" {
            match previous.take() {
                Some((before, block))
                    if before == "toml" && block.trim_start().starts_with("[dependencies]") =>
                {
                    found.push(Snippet {
                        file: file.to_owned(),
                        line: number + 1,
                        dependencies: block,
                        code: rustdoc_code(&body),
                    });
                }
                _ => problems.push(format!(
                    "{file}:{}: a rust block without a ```toml [dependencies] block right before it",
                    number + 1
                )),
            }
        } else {
            previous = Some((language.to_owned(), body));
        }
    }
    if problems.is_empty() {
        Ok(found)
    } else {
        Err(problems)
    }
}

/// `body` as rustdoc compiles it: hidden lines shown, unused items
/// allowed, and wrapped in a `main` when it has none.
fn rustdoc_code(body: &str) -> String {
    let code: String = body
        .lines()
        .map(|line| {
            let shown = match line.trim_start() {
                "#" => "",
                trimmed => trimmed.strip_prefix("# ").map_or(line, |rest| rest),
            };
            format!("{shown}\n")
        })
        .collect();
    // As rustdoc: an example need not use everything it shows.
    if code.contains("fn main(") {
        format!("#![allow(unused)]\n{code}")
    } else {
        format!("#![allow(unused)]\nfn main() {{\n{code}}}\n")
    }
}

/// The block's dependency lines with each workspace crate in `crates`
/// (name and directory) given its path as well.
fn with_paths(block: &str, crates: &BTreeMap<String, String>) -> Result<String, String> {
    let mut out = String::new();
    for line in block.lines() {
        let name = line.split('=').next().unwrap_or_default().trim();
        let Some(dir) = crates.get(name) else {
            out.push_str(line);
            out.push('\n');
            continue;
        };
        let value = line
            .split_once('=')
            .map(|(_, v)| v.trim())
            .unwrap_or_default();
        let table = if let Some(version) = value.strip_prefix('"') {
            format!("{{ version = \"{version}, path = {dir:?} }}")
        } else if let Some(inner) = value.strip_prefix('{') {
            format!("{{ path = {dir:?}, {}", inner.trim_start())
        } else {
            return Err(format!("cannot read the dependency line `{line}`"));
        };
        out.push_str(&format!("{name} = {table}\n"));
    }
    Ok(out)
}

/// The workspace's crates by package name, with their directories.
fn workspace_crates(root: &Path) -> Result<BTreeMap<String, String>, String> {
    let mut crates = BTreeMap::new();
    let dir = root.join("crates");
    let entries = fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for entry in entries.flatten() {
        let manifest = entry.path().join("Cargo.toml");
        let Ok(text) = fs::read_to_string(&manifest) else {
            continue;
        };
        let name = text
            .lines()
            .find_map(|l| l.strip_prefix("name = \""))
            .and_then(|rest| rest.strip_suffix('"'));
        if let Some(name) = name {
            crates.insert(name.to_owned(), entry.path().display().to_string());
        }
    }
    Ok(crates)
}

/// The workspace manifest's `[profile...]` sections, so that the fresh
/// crates build their dependencies as the workspace does (and reuse them).
fn profiles(root: &Path) -> Result<String, String> {
    let manifest = root.join("Cargo.toml");
    let text = fs::read_to_string(&manifest).map_err(|e| format!("{}: {e}", manifest.display()))?;
    let mut out = String::new();
    let mut inside = false;
    for line in text.lines() {
        if line.starts_with('[') {
            inside = line.starts_with("[profile");
        }
        if inside {
            out.push_str(line);
            out.push('\n');
        }
    }
    Ok(out)
}

/// Writes one crate per dependency block under `target/readme-crates/`
/// and builds each with `cargo`.
pub(crate) fn run(root: &Path) -> Result<(), String> {
    let mut snippets = Vec::new();
    let mut problems = Vec::new();
    for file in documents(root)? {
        let text = fs::read_to_string(root.join(&file)).map_err(|e| format!("{file}: {e}"))?;
        match self::snippets(&file, &text) {
            Ok(found) => snippets.extend(found),
            Err(found) => problems.extend(found),
        }
    }
    if !problems.is_empty() {
        return Err(problems.join("\n"));
    }
    let crates = workspace_crates(root)?;
    let profiles = profiles(root)?;
    let lock = root.join("Cargo.lock");
    let mut groups: BTreeMap<&str, Vec<&Snippet>> = BTreeMap::new();
    for snippet in &snippets {
        groups
            .entry(&snippet.dependencies)
            .or_default()
            .push(snippet);
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let base = root.join("target").join("readme-crates");
    for (index, (block, members)) in groups.iter().enumerate() {
        let dir = base.join(format!("deps-{index}"));
        let bins = dir.join("src").join("bin");
        let _ = fs::remove_dir_all(&bins);
        fs::create_dir_all(&bins).map_err(|e| format!("{}: {e}", bins.display()))?;
        let places = members
            .iter()
            .map(|s| format!("{}:{}", s.file, s.line))
            .collect::<Vec<_>>()
            .join(", ");
        let manifest = format!(
            "# Written by `cargo xtask readme`: the snippets of {places}.\n\
             [package]\nname = \"readme-deps-{index}\"\nversion = \"0.0.0\"\nedition = \"2024\"\npublish = false\n\n\
             # Not a member of the markov workspace it sits in.\n[workspace]\n\n{deps}\n{profiles}",
            deps = with_paths(block, &crates)?,
        );
        let write = |path: &Path, text: &str| {
            fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
        };
        write(&dir.join("Cargo.toml"), &manifest)?;
        fs::copy(&lock, dir.join("Cargo.lock")).map_err(|e| format!("{}: {e}", lock.display()))?;
        for snippet in members {
            write(&bins.join(bin_name(snippet)), &snippet.code)?;
        }
        println!(
            "$ cargo build --offline --bins --manifest-path {} ({places})",
            dir.join("Cargo.toml").display(),
        );
        let status = Command::new(&cargo)
            .args(["build", "--offline", "--bins", "--manifest-path"])
            .arg(dir.join("Cargo.toml"))
            .env("CARGO_TARGET_DIR", root.join("target"))
            .status()
            .map_err(|e| format!("cannot start cargo: {e}"))?;
        if !status.success() {
            return Err(format!(
                "the snippets of {places} do not build with the dependencies shown before them ({})",
                dir.display()
            ));
        }
    }
    println!(
        "xtask: {} snippets of the README and the guide build with their dependency blocks",
        snippets.len()
    );
    Ok(())
}

/// The documents whose snippets are built: `README.md` and every
/// `docs/guide/*.md`, relative to `root`, sorted.
pub(crate) fn documents(root: &Path) -> Result<Vec<String>, String> {
    let guide = root.join("docs").join("guide");
    let mut pages: Vec<String> = fs::read_dir(&guide)
        .map_err(|e| format!("{}: {e}", guide.display()))?
        .flatten()
        .filter_map(|entry| entry.file_name().into_string().ok())
        .filter(|name| name.ends_with(".md"))
        .map(|name| format!("docs/guide/{name}"))
        .collect();
    pages.sort();
    pages.insert(0, "README.md".to_owned());
    Ok(pages)
}

/// The file name of a snippet's bin: its document and line.
fn bin_name(snippet: &Snippet) -> String {
    let stem = Path::new(&snippet.file)
        .file_stem()
        .map(|s| s.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    let prefix = if snippet.file.starts_with("docs/guide/") {
        "guide-"
    } else {
        ""
    };
    format!("{prefix}{stem}-line{}.rs", snippet.line)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rust_block_needs_a_dependency_block_right_before_it() {
        let readme = "text\n```toml\n[dependencies]\nmarkov = \"0.1\"\n```\nmore\n```rust\nfn main() {}\n```\n```rust\nlet x = 1;\n```\n";
        let problems = snippets("README.md", readme).expect_err("the second block has none");
        assert_eq!(problems.len(), 1);
        assert!(problems[0].starts_with("README.md:10:"), "{problems:?}");
        let readme = "```toml\n[dependencies]\nmarkov = \"0.1\"\n```\n```rust,no_run\n# fn x() {}\nlet x = 1;\n```\n";
        let found = snippets("docs/guide/x.md", readme).expect("paired");
        assert_eq!(bin_name(&found[0]), "guide-x-line5.rs");
        assert_eq!(found[0].dependencies, "[dependencies]\nmarkov = \"0.1\"\n");
        assert_eq!(
            found[0].code,
            "#![allow(unused)]\nfn main() {\nfn x() {}\nlet x = 1;\n}\n"
        );
    }

    #[test]
    fn ignored_blocks_are_not_built() {
        let page = "```rust,ignore\nlet runner = Runner::new(..);\n```\n";
        assert_eq!(snippets("docs/guide/evals.md", page), Ok(Vec::new()));
        let problems = snippets("docs/guide/x.md", "```rust\nlet x = 1;\n```\n")
            .expect_err("no dependency block");
        assert!(
            problems[0].starts_with("docs/guide/x.md:1:"),
            "{problems:?}"
        );
    }

    #[test]
    fn workspace_crates_get_their_paths() {
        let crates = BTreeMap::from([("markov".to_owned(), "/w/crates/markov".to_owned())]);
        let block = "[dependencies]\nmarkov = { version = \"0.1\", features = [\"server\"] }\ntokio = \"1\"\n";
        assert_eq!(
            with_paths(block, &crates).unwrap(),
            "[dependencies]\nmarkov = { path = \"/w/crates/markov\", version = \"0.1\", features = [\"server\"] }\ntokio = \"1\"\n"
        );
        assert_eq!(
            with_paths("markov = \"0.1\"", &crates).unwrap(),
            "markov = { version = \"0.1\", path = \"/w/crates/markov\" }\n"
        );
    }
}
