//! `cargo xtask stats [<dir>]`: production lines and `pub` items per crate,
//! as a table, so a change that means to make the crates smaller can say
//! by how much.
//!
//! Production code is every `.rs` file under a crate's `src/` (and
//! `xtask/src/`), without the modules compiled for tests only: a
//! `#[cfg(test)] mod name { .. }` block (or `#[cfg(doctest)]`), and the
//! file a `#[cfg(test)] mod name;` line names. `tests/`, `benches/` and
//! `examples/` are not production code. Lines are the non-blank ones, doc
//! comments included. A `pub` item is a line that starts with `pub` (not
//! `pub(crate)` or `pub(super)`) followed by an item keyword: `fn`,
//! `struct`, `enum`, `trait`, `type`, `const`, `static`, `mod`, `use`,
//! `union` or `macro`; public fields are not items. The scan is textual,
//! which is exact enough for a before-and-after comparison.
//!
//! `<dir>` is another checkout of the workspace (for the figures of
//! another revision: `git archive <rev> | tar -x -C <dir>`); the default is
//! this one.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// One crate's figures.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Figures {
    /// Production files counted.
    pub(crate) files: usize,
    /// Non-blank production lines.
    pub(crate) lines: usize,
    /// `pub` items.
    pub(crate) pub_items: usize,
}

impl Figures {
    fn add(&mut self, other: &Figures) {
        self.files += other.files;
        self.lines += other.lines;
        self.pub_items += other.pub_items;
    }
}

/// Prints the table for the workspace at `root`.
pub(crate) fn run(root: &Path) -> Result<(), String> {
    let mut rows = Vec::new();
    let crates = root.join("crates");
    let mut dirs: Vec<PathBuf> = fs::read_dir(&crates)
        .map_err(|e| format!("{}: {e}", crates.display()))?
        .flatten()
        .map(|entry| entry.path())
        .filter(|dir| dir.join("Cargo.toml").is_file())
        .collect();
    dirs.sort();
    dirs.push(root.join("xtask"));
    for dir in dirs {
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let shown = if name == "xtask" {
            name
        } else {
            format!("crates/{name}")
        };
        rows.push((shown, crate_figures(&dir.join("src"))?));
    }
    print!("{}", table(&rows));
    Ok(())
}

/// The table: one row per crate and a total.
fn table(rows: &[(String, Figures)]) -> String {
    let mut total = Figures::default();
    let mut out = String::from("| crate | files | lines | pub items |\n|---|---:|---:|---:|\n");
    for (name, figures) in rows {
        total.add(figures);
        out.push_str(&format!(
            "| {name} | {} | {} | {} |\n",
            figures.files, figures.lines, figures.pub_items
        ));
    }
    out.push_str(&format!(
        "| total | {} | {} | {} |\n",
        total.files, total.lines, total.pub_items
    ));
    out
}

/// The figures of the production files under `src`.
fn crate_figures(src: &Path) -> Result<Figures, String> {
    let mut files = Vec::new();
    collect(src, &mut files)?;
    files.sort();
    // Files that a `#[cfg(test)] mod name;` line makes test-only.
    let mut test_only = BTreeSet::new();
    let mut texts = Vec::new();
    for path in files {
        let text = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        for module in test_module_files(&text) {
            let dir = module_dir(&path);
            test_only.insert(dir.join(format!("{module}.rs")));
            test_only.insert(dir.join(&module));
        }
        texts.push((path, text));
    }
    let mut figures = Figures::default();
    for (path, text) in texts {
        if test_only
            .iter()
            .any(|excluded| path == *excluded || path.starts_with(excluded))
        {
            continue;
        }
        figures.add(&file_figures(&text));
    }
    Ok(figures)
}

/// The directory in which the modules a file declares live: its own for
/// `lib.rs`, `main.rs` and `mod.rs`, else one named after it.
fn module_dir(path: &Path) -> PathBuf {
    let parent = path.parent().unwrap_or(Path::new("")).to_path_buf();
    match path.file_stem().and_then(|s| s.to_str()) {
        Some("lib" | "main" | "mod") | None => parent,
        Some(stem) => parent.join(stem),
    }
}

/// The `.rs` files under `dir`, recursively.
fn collect(dir: &Path, files: &mut Vec<PathBuf>) -> Result<(), String> {
    if !dir.is_dir() {
        return Ok(());
    }
    for entry in fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let path = entry.map_err(|e| format!("{}: {e}", dir.display()))?.path();
        if path.is_dir() {
            collect(&path, files)?;
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            files.push(path);
        }
    }
    Ok(())
}

/// The names of the modules `text` declares as `#[cfg(test)] mod name;`.
fn test_module_files(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut after_cfg_test = false;
    for line in text.lines().map(str::trim) {
        if is_cfg_test(line) {
            after_cfg_test = true;
            continue;
        }
        if after_cfg_test
            && let Some(name) = module_declaration(line)
            && let Some(name) = name.strip_suffix(';')
        {
            found.push(name.trim().to_owned());
        }
        if !line.starts_with("#[") && !line.is_empty() {
            after_cfg_test = false;
        }
    }
    found
}

/// `#[cfg(test)]` or `#[cfg(doctest)]`, also when it is one condition of
/// several (`all(..)`).
fn is_cfg_test(line: &str) -> bool {
    let test = line == "#[cfg(test)]" || line.contains("(test,") || line.contains(", test)");
    let doctest = line.contains("(doctest") || line.contains(", doctest");
    line.starts_with("#[cfg(") && (test || doctest) && !line.contains("not(")
}

/// What follows `mod ` (or `pub mod `, `pub(crate) mod `) on `line`.
fn module_declaration(line: &str) -> Option<&str> {
    let rest = line
        .strip_prefix("pub(crate) ")
        .or_else(|| line.strip_prefix("pub(super) "))
        .or_else(|| line.strip_prefix("pub "))
        .unwrap_or(line);
    rest.strip_prefix("mod ")
}

/// The lines and `pub` items of one file, without its inline
/// `#[cfg(test)] mod name { .. }` blocks.
fn file_figures(text: &str) -> Figures {
    let mut figures = Figures {
        files: 1,
        ..Figures::default()
    };
    let lines: Vec<&str> = text.lines().collect();
    let mut index = 0;
    let mut after_cfg_test = false;
    while index < lines.len() {
        let line = lines[index].trim();
        if is_cfg_test(line) {
            after_cfg_test = true;
            index += 1;
            continue;
        }
        if after_cfg_test
            && let Some(rest) = module_declaration(line)
            && !rest.trim_end().ends_with(';')
        {
            index = end_of_block(&lines, index);
            after_cfg_test = false;
            continue;
        }
        if !line.starts_with("#[") && !line.is_empty() {
            after_cfg_test = false;
        }
        if after_cfg_test {
            // The attribute lines above a test module are the module's.
            index += 1;
            continue;
        }
        if !line.is_empty() {
            figures.lines += 1;
        }
        if is_pub_item(line) {
            figures.pub_items += 1;
        }
        index += 1;
    }
    figures
}

/// The index of the line after the block that opens at `start`: braces
/// counted outside strings, characters and comments.
fn end_of_block(lines: &[&str], start: usize) -> usize {
    let mut depth: i64 = 0;
    let mut opened = false;
    let mut in_block_comment = 0usize;
    for (index, line) in lines.iter().enumerate().skip(start) {
        let chars: Vec<char> = line.chars().collect();
        let mut at = 0;
        while at < chars.len() {
            let c = chars[at];
            let next = chars.get(at + 1).copied();
            if in_block_comment > 0 {
                if c == '*' && next == Some('/') {
                    in_block_comment -= 1;
                    at += 2;
                } else if c == '/' && next == Some('*') {
                    in_block_comment += 1;
                    at += 2;
                } else {
                    at += 1;
                }
                continue;
            }
            match c {
                '/' if next == Some('/') => break,
                '/' if next == Some('*') => {
                    in_block_comment += 1;
                    at += 2;
                }
                '"' => at = skip_string(&chars, at + 1),
                'r' if matches!(next, Some('"' | '#'))
                    && (at == 0 || !chars[at - 1].is_alphanumeric()) =>
                {
                    at = skip_raw_string(&chars, at + 1);
                }
                '\'' => at = skip_char(&chars, at),
                '{' => {
                    depth += 1;
                    opened = true;
                    at += 1;
                }
                '}' => {
                    depth -= 1;
                    at += 1;
                    if opened && depth == 0 {
                        return index + 1;
                    }
                }
                _ => at += 1,
            }
        }
    }
    lines.len()
}

/// The position after the string whose text starts at `at`. A string
/// that runs past the line ends it (multi-line strings in test modules
/// are rare, and their braces are balanced in practice).
fn skip_string(chars: &[char], mut at: usize) -> usize {
    while at < chars.len() {
        match chars[at] {
            '\\' => at += 2,
            '"' => return at + 1,
            _ => at += 1,
        }
    }
    chars.len()
}

/// The position after the raw string whose `#`s or quote start at `at`.
fn skip_raw_string(chars: &[char], mut at: usize) -> usize {
    let mut hashes = 0;
    while chars.get(at) == Some(&'#') {
        hashes += 1;
        at += 1;
    }
    if chars.get(at) != Some(&'"') {
        return at;
    }
    at += 1;
    while at < chars.len() {
        if chars[at] == '"' && (1..=hashes).all(|k| chars.get(at + k) == Some(&'#')) {
            return at + 1 + hashes;
        }
        at += 1;
    }
    chars.len()
}

/// The position after a character literal at `at`, or after the quote of
/// a lifetime.
fn skip_char(chars: &[char], at: usize) -> usize {
    match (chars.get(at + 1), chars.get(at + 2)) {
        (Some('\\'), _) => chars[at + 2..]
            .iter()
            .position(|&c| c == '\'')
            .map_or(chars.len(), |end| at + 3 + end),
        (Some(_), Some('\'')) => at + 3,
        _ => at + 1,
    }
}

/// Whether `line` declares a public item.
fn is_pub_item(line: &str) -> bool {
    let Some(mut rest) = line.strip_prefix("pub ") else {
        return false;
    };
    while let Some(after) = ["async ", "unsafe ", "extern \"C\" "]
        .iter()
        .find_map(|qualifier| rest.strip_prefix(qualifier))
    {
        rest = after;
    }
    [
        "fn ", "struct ", "enum ", "trait ", "type ", "const ", "static ", "mod ", "use ",
        "union ", "macro ",
    ]
    .iter()
    .any(|keyword| rest.starts_with(keyword))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_modules_and_blank_lines_are_not_counted() {
        let text = "//! Docs.\n\npub fn a() {}\nfn b() { let s = \"}\"; }\npub struct S {\n    pub field: u8,\n}\n\n#[cfg(test)]\nmod tests {\n    pub fn helper() { let c = '}'; }\n    #[test]\n    fn t() {}\n}\npub(crate) fn c() {}\n";
        assert_eq!(
            file_figures(text),
            Figures {
                files: 1,
                lines: 7,
                pub_items: 2
            }
        );
    }

    #[test]
    fn a_test_module_in_its_own_file_is_left_out() {
        assert_eq!(
            test_module_files(
                "#[cfg(test)]\nmod tests;\nmod real;\n#[cfg(all(test, unix))]\npub(crate) mod fixtures;\n"
            ),
            ["tests", "fixtures"]
        );
        assert!(test_module_files("#[cfg(not(test))]\nmod real;\n").is_empty());
        assert!(is_cfg_test("#[cfg(all(doctest, feature = \"server\"))]"));
        assert_eq!(module_dir(Path::new("src/lib.rs")), Path::new("src"));
        assert_eq!(module_dir(Path::new("src/a/mod.rs")), Path::new("src/a"));
        assert_eq!(module_dir(Path::new("src/a.rs")), Path::new("src/a"));
    }

    #[test]
    fn pub_items_are_items_not_fields() {
        for item in [
            "pub fn f() {",
            "pub async fn f() {",
            "pub const fn f() {",
            "pub struct S;",
            "pub enum E {",
            "pub trait T {",
            "pub type A = u8;",
            "pub const N: u8 = 1;",
            "pub static S: u8 = 1;",
            "pub mod m;",
            "pub use a::b;",
            "pub unsafe fn f() {",
        ] {
            assert!(is_pub_item(item), "{item}");
        }
        for other in [
            "pub field: u8,",
            "pub(crate) fn f() {",
            "fn f() {",
            "pub(super) struct S;",
        ] {
            assert!(!is_pub_item(other), "{other}");
        }
    }

    #[test]
    fn a_block_ends_at_its_closing_brace() {
        let lines = [
            "mod tests {",
            "    let s = r#\"}\"#;",
            "    /* } */ let c = '{';",
            "    fn f<'a>(x: &'a str) {}",
            "}",
            "after",
        ];
        assert_eq!(end_of_block(&lines, 0), 5);
    }

    #[test]
    fn the_table_has_a_total() {
        let rows = [
            (
                "crates/a".to_owned(),
                Figures {
                    files: 1,
                    lines: 10,
                    pub_items: 2,
                },
            ),
            (
                "xtask".to_owned(),
                Figures {
                    files: 2,
                    lines: 5,
                    pub_items: 0,
                },
            ),
        ];
        assert_eq!(
            table(&rows),
            "| crate | files | lines | pub items |\n|---|---:|---:|---:|\n| crates/a | 1 | 10 | 2 |\n| xtask | 2 | 5 | 0 |\n| total | 3 | 15 | 2 |\n"
        );
    }
}
