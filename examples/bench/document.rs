//! The report file. Each scenario's section sits between stable markers
//! (`<!-- bench:cycle -->` … `<!-- /bench:cycle -->`, invisible once
//! rendered) and carries the stamp of the run that measured it, so a run of
//! some scenarios (`--only`) replaces their sections and plots and keeps the
//! others as they were. The header, the Targets table (from the target rows
//! each section keeps, in comments, beside its stamp) and the notes are
//! written anew every time: nothing in the file is written by hand.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::plots::Plot;
use crate::stamp::{self, RunFacts};
use crate::{BoxError, Config, Res};

/// The sections, in the file's order; their ids are `--only`'s names.
pub const ORDER: [&str; 9] = [
    "cycle", "handoff", "macro", "held", "cross", "server", "election", "acks", "modes",
];

/// One target a section judges.
pub struct Target {
    pub what: String,
    pub measured: String,
    pub met: bool,
}

/// One scenario's section, as this run measured it.
pub struct Section {
    id: &'static str,
    /// The heading, "1. Uncontended cycle".
    title: String,
    started: String,
    load_start: String,
    load_end: String,
    /// The Markdown under the heading and the stamp.
    pub body: String,
    pub targets: Vec<Target>,
    pub plots: Vec<Plot>,
}

impl Section {
    /// Starts a section: notes the time and the load it starts under.
    pub fn begin(id: &'static str, title: &str) -> Self {
        debug_assert!(ORDER.contains(&id));
        Section {
            id,
            title: title.into(),
            started: stamp::now_utc(),
            load_start: stamp::load(),
            load_end: String::new(),
            body: String::new(),
            targets: Vec::new(),
            plots: Vec::new(),
        }
    }

    /// Ends the section: notes the load it ends under.
    pub fn end(mut self) -> Self {
        self.load_end = stamp::load();
        self
    }

    /// Adds a target.
    pub fn target(&mut self, what: impl Into<String>, measured: impl Into<String>, met: bool) {
        self.targets.push(Target {
            what: what.into(),
            measured: measured.into(),
            met,
        });
    }

    /// The section's Markdown, markers included, its plots found in
    /// `plot_dir` (relative to the report).
    fn render(&self, facts: &RunFacts, plot_dir: &str) -> String {
        let (open, close) = markers(self.id);
        let mut out = format!("{open}\n## {}\n\n", self.title);
        out.push_str(&facts.stamp(&self.started, &self.load_start, &self.load_end));
        out.push('\n');
        let number = self.title.split('.').next().unwrap_or_default();
        for t in &self.targets {
            let _ = writeln!(
                out,
                "{TARGET}| {} | {} | {} | [{number}](#{}), {} | -->",
                t.what,
                t.measured,
                if t.met { "**met**" } else { "**missed**" },
                slug(&self.title),
                self.started
            );
        }
        if !self.targets.is_empty() {
            out.push('\n');
        }
        out.push_str(self.body.trim_end());
        out.push_str("\n\n");
        for plot in &self.plots {
            let _ = writeln!(out, "![{}]({plot_dir}/{})\n", plot.alt, plot.file);
        }
        let _ = writeln!(out, "{close}");
        out
    }
}

/// How a section keeps a row of the Targets table.
const TARGET: &str = "<!-- bench:target ";

fn markers(id: &str) -> (String, String) {
    (
        format!("<!-- bench:{id} -->"),
        format!("<!-- /bench:{id} -->"),
    )
}

/// A heading's anchor as GitHub makes it.
fn slug(heading: &str) -> String {
    heading
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The sections of an existing report by id, markers included, read
/// before anything is measured: a report whose markers are damaged
/// (an opening marker without its closing one, a section twice, a marker
/// inside another section) or missing altogether (a file that was not
/// written by this benchmark) is refused, so that no run drops or doubles
/// a section it did not measure. An empty or absent file has none.
pub fn existing_sections(out: &Path) -> Res<Vec<(&'static str, String)>> {
    let text = match std::fs::read_to_string(out) {
        Ok(text) => text,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(err) => return Err(format!("{}: {err}", out.display()).into()),
    };
    let damaged = |what: String| -> BoxError {
        format!(
            "{}: {what}; run the whole benchmark (no --only) to write it anew, or give --out another file",
            out.display()
        )
        .into()
    };
    if text.trim().is_empty() {
        return Ok(Vec::new());
    }
    if !text.contains("<!-- Written by examples/bench") {
        return Err(damaged(
            "not written by this benchmark (no section markers)".into(),
        ));
    }
    // Every marker, in the order it appears.
    let mut found = Vec::new();
    for id in ORDER {
        let (open, close) = markers(id);
        for (at, _) in text.match_indices(&open) {
            found.push((at, id, true));
        }
        for (at, _) in text.match_indices(&close) {
            found.push((at, id, false));
        }
    }
    found.sort();
    let mut sections: Vec<(&'static str, String)> = Vec::new();
    let mut open: Option<(usize, &'static str)> = None;
    for (at, id, opens) in found {
        match (open, opens) {
            (None, true) if sections.iter().any(|(seen, _)| *seen == id) => {
                return Err(damaged(format!("the section `{id}` is there twice")));
            }
            (None, true) => open = Some((at, id)),
            (Some((_, inside)), true) => {
                return Err(damaged(format!(
                    "the section `{id}` starts inside the section `{inside}`"
                )));
            }
            (Some((start, inside)), false) if inside == id => {
                let end = at + markers(id).1.len();
                sections.push((id, text[start..end].to_owned()));
                open = None;
            }
            (_, false) => {
                return Err(damaged(format!(
                    "the section `{id}` ends where it did not start"
                )));
            }
        }
    }
    if let Some((_, id)) = open {
        return Err(damaged(format!("the section `{id}` never ends")));
    }
    Ok(sections)
}

/// Where the plots of the report at `out` go, relative to it: a directory
/// named after the file (`BENCHMARKS.md`: `benchmarks/`).
fn plot_dir(out: &Path) -> String {
    out.file_stem()
        .map_or("bench".into(), |s| s.to_string_lossy().to_lowercase())
}

/// Writes this run's sections and their plots into the report at
/// `cfg.out`, keeping the sections of the existing file that this run did
/// not measure; returns the file's text.
pub fn write(
    cfg: &Config,
    existing: &[(&'static str, String)],
    facts: &RunFacts,
    sections: &[Section],
) -> Res<String> {
    let dir = plot_dir(&cfg.out);
    let parent = cfg
        .out
        .parent()
        .map_or(PathBuf::from("."), Path::to_path_buf);
    // The smoke's `target/` is not there when cargo builds elsewhere.
    std::fs::create_dir_all(&parent)?;
    for section in sections {
        if !section.plots.is_empty() {
            std::fs::create_dir_all(parent.join(&dir))?;
        }
        for plot in &section.plots {
            std::fs::write(parent.join(&dir).join(&plot.file), &plot.svg)?;
        }
    }
    let mut kept = Vec::new();
    let texts: Vec<String> = ORDER
        .iter()
        .filter_map(|id| match sections.iter().find(|s| s.id == *id) {
            Some(section) => Some(section.render(facts, &dir)),
            None => existing
                .iter()
                .find(|(seen, _)| seen == id)
                .map(|(_, text)| {
                    kept.push(*id);
                    text.clone()
                }),
        })
        .collect();
    if !kept.is_empty() {
        eprintln!("kept from {}: {}", cfg.out.display(), kept.join(", "));
    }
    let mut out = header(&dir);
    out.push_str(&targets_table(&texts));
    for text in &texts {
        let _ = writeln!(out, "{}\n", text.trim_end());
    }
    out.push_str(NOTES);
    std::fs::write(&cfg.out, &out)?;
    Ok(out)
}

/// The top of the report: what it is and how to regenerate it, whole or
/// some sections; its plots are in `dir`.
fn header(dir: &str) -> String {
    format!(
        "# Benchmarks\n\n<!-- Written by examples/bench: change the benchmark, not this file. -->\n\
         Written wholly by the benchmark, `examples/bench/`: dlock beside the raw floor (its own commands sent by hand) and the crates users would pick instead, against local Redis and PostgreSQL servers. It measures and never asserts a time. Each section is stamped with the run that measured it (when, the command, the machine and its load average, the servers' versions and round trip, the build), since sections can be measured in runs of their own; the load average tells how busy the machine was.\n\n\
         - The whole file and its plots (`{dir}/*.svg`): `cargo run --release --example bench` (about 11 minutes).\n\
         - Some sections: `cargo run --release --example bench -- --only cycle,handoff` replaces those sections, their targets and their plots, and keeps the others as they are. The sections, in order: {}.\n\n",
        ORDER.map(|id| format!("`{id}`")).join(", ")
    )
}

/// The Targets table: the target rows the sections keep, in their order.
fn targets_table(texts: &[String]) -> String {
    let mut out = String::new();
    let rows: Vec<&str> = texts
        .iter()
        .flat_map(|text| text.lines())
        .filter_map(|line| line.strip_prefix(TARGET)?.strip_suffix(" -->"))
        .collect();
    if !rows.is_empty() {
        let _ = writeln!(
            out,
            "## Targets\n\n| target | measured | | measured in |\n| --- | --- | --- | --- |"
        );
        for row in rows {
            let _ = writeln!(out, "{row}");
        }
        out.push('\n');
    }
    out
}

/// What each row does, and what limits the figures.
const NOTES: &str = include_str!("notes.md");
