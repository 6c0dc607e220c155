//! The modules of `src/pg` import each other one way: a file that needs
//! what a sibling imports from it is a seam in the wrong place (STYLE.md).
//! Reads the sources, so it needs no server and no feature.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

/// Each module of `src/pg` (a file, or a folder taken as one), with the
/// code of its files, each with how many `super::` name `src/pg` there:
/// `mod.rs` itself is the parent, not a sibling.
fn modules(pg: &Path) -> BTreeMap<String, Vec<(String, usize)>> {
    let mut modules = BTreeMap::new();
    for entry in fs::read_dir(pg).expect("src/pg is readable") {
        let path = entry.expect("src/pg is listable").path();
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        let files = if path.is_dir() {
            let inside = fs::read_dir(&path)
                .unwrap()
                .map(|file| file.unwrap().path());
            let depth = |file: &Path| if file.ends_with("mod.rs") { 1 } else { 2 };
            inside
                .map(|file| (code(&fs::read_to_string(&file).unwrap()), depth(&file)))
                .collect()
        } else if name != "mod" && path.extension().is_some_and(|e| e == "rs") {
            vec![(code(&fs::read_to_string(&path).unwrap()), 1)]
        } else {
            continue;
        };
        modules.insert(name, files);
    }
    modules
}

/// `text` without its `//` comments.
fn code(text: &str) -> String {
    text.lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The identifiers of a path or a `{…}` group that follows `crate::pg::`,
/// or `super::` repeated `depth` times, anywhere in `code`.
fn named_after_parent(code: &str, depth: usize) -> Vec<String> {
    let mut names = Vec::new();
    for prefix in ["super::".repeat(depth), "crate::pg::".to_owned()] {
        for (at, _) in code.match_indices(&prefix) {
            let after_super = code[..at].ends_with("super::");
            let rest = &code[at + prefix.len()..];
            if after_super || rest.starts_with("super::") {
                continue;
            }
            let end = if rest.starts_with('{') {
                let mut depth = 0;
                rest.char_indices()
                    .find(|&(_, c)| {
                        depth += i32::from(c == '{') - i32::from(c == '}');
                        depth == 0
                    })
                    .map_or(rest.len(), |(i, _)| i)
            } else {
                rest.find(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .unwrap_or(rest.len())
            };
            names.extend(
                rest[..end]
                    .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .filter(|word| !word.is_empty())
                    .map(str::to_owned),
            );
        }
    }
    names
}

/// Which sibling each item `mod.rs` takes in with `use self::sibling::…`
/// comes from: importing it from `super` imports that sibling.
fn reexported(mod_rs: &str) -> BTreeMap<String, String> {
    let mut from = BTreeMap::new();
    for (at, _) in mod_rs.match_indices("use self::") {
        let rest = &mod_rs[at + "use self::".len()..];
        let statement = &rest[..rest.find(';').unwrap_or(rest.len())];
        if let Some((sibling, items)) = statement.split_once("::") {
            for item in items.split(|c: char| !(c.is_alphanumeric() || c == '_')) {
                if !item.is_empty() {
                    from.insert(item.to_owned(), sibling.to_owned());
                }
            }
        }
    }
    from
}

/// A cycle of imports among `graph`'s modules, if there is one.
fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        module: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|m| m == module) {
            let mut found = path[at..].to_vec();
            found.push(module.to_owned());
            return Some(found);
        }
        if !done.insert(module.to_owned()) {
            return None;
        }
        path.push(module.to_owned());
        for next in &graph[module] {
            if let Some(found) = visit(next, graph, path, done) {
                return Some(found);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|module| visit(module, graph, &mut Vec::new(), &mut done))
}

#[test]
fn pg_modules_import_each_other_one_way() {
    let pg = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/pg");
    let modules = modules(&pg);
    let from = reexported(&code(&fs::read_to_string(pg.join("mod.rs")).unwrap()));
    let graph: BTreeMap<String, BTreeSet<String>> = modules
        .iter()
        .map(|(module, files)| {
            let imports = files
                .iter()
                .flat_map(|(code, depth)| named_after_parent(code, *depth))
                .filter_map(|name| match modules.contains_key(&name) {
                    true => Some(name),
                    false => from.get(&name).cloned(),
                })
                .filter(|sibling| sibling != module)
                .collect();
            (module.clone(), imports)
        })
        .collect();
    assert!(
        graph.len() > 20,
        "read too few modules of {}: {graph:?}",
        pg.display()
    );
    if let Some(cycle) = cycle(&graph) {
        panic!("src/pg imports in a cycle: {}", cycle.join(" -> "));
    }
}
