//! The runs of the test binary, overlapped. A fault run spends most of its
//! fixed length waiting (a driver asleep between faults, stopped processes,
//! ttls running out), so many runs share a small machine well; but libtest
//! runs only as many tests at once as it has threads (by default the number
//! of cores: 2 in CI). So the first run test to start launches the run of
//! every run test this invocation will run, each in a thread of its own, at
//! once; every run test then waits for its own run's report and asserts on
//! it. What each test asserts is unchanged; only when its run happens is.
//!
//! Which tests will run is read from the command line as libtest reads it:
//! the free arguments are filters (a test runs if its name contains one,
//! or equals one with `--exact`; every test runs when there is none),
//! `--skip` leaves out the tests it matches (the same way), and `--ignored`
//! without `--include-ignored` runs only ignored tests, which the runs are
//! not. So `cargo test --test fault_injection redis_locks` starts only the
//! runs whose tests have `redis_locks` in their names. A test whose run was
//! not launched (should this reading ever differ from libtest's) makes its
//! run itself, in its own thread, as before.
//!
//! At most [`DEFAULT_AT_ONCE`] launched runs go at once (the others wait
//! their turn, in the table's order), `DLOCK_FAULT_OVERLAP=<n>` at most `n`:
//! every run's workers and register hold PostgreSQL connections, and all
//! of the runs at once (lock, election, fair, permits and read-write runs on
//! every store) would pass the server's default `max_connections` of 100.
//!
//! A launched run does not print as it goes (its lines would land in the
//! output of whichever test launched it): its test prints the run's log
//! when the report comes, so libtest shows it with that test's result. With
//! `--nocapture` (or `RUST_TEST_NOCAPTURE`) runs print as they go, each line
//! as a whole.

use std::collections::HashMap;

/// How many launched runs go at once unless `DLOCK_FAULT_OVERLAP` says:
/// about 80 PostgreSQL connections at the peak, the short runs' total in
/// about 90 s of wall time on two cores.
pub const DEFAULT_AT_ONCE: usize = 8;
use std::panic::resume_unwind;
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::thread::JoinHandle;

use super::run::{Report, Settings, run};
use crate::support::seeds::{env_seed, seeds};

/// A run test: its name (the test function's) and its run's settings.
pub struct Entry {
    pub name: &'static str,
    pub settings: fn() -> Settings,
}

/// The launched runs, by test name, taken out by the test that waits.
static LAUNCHED: OnceLock<Mutex<Launched>> = OnceLock::new();

/// The runs of each test, by its name: one a seed.
type Launched = HashMap<&'static str, Vec<JoinHandle<Report>>>;

/// The reports of the runs of test `name` (an entry of `runs`, the table
/// of every run test of the binary), one a seed of the test's
/// ([`seeds_of`]), each log printed: launched with every selected run by
/// the first call, or made here if they were not launched.
pub fn report(name: &str, runs: &[Entry]) -> Vec<Report> {
    let launched = LAUNCHED.get_or_init(|| Mutex::new(launch(runs)));
    let handles = launched
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .remove(name);
    let reports: Vec<Report> = match handles {
        // A run's panic was printed in its own thread, into whichever
        // test's output launched it: say it again here.
        Some(handles) => handles
            .into_iter()
            .map(|handle| {
                handle.join().unwrap_or_else(|panic| {
                    let message = panic
                        .downcast_ref::<String>()
                        .map(String::as_str)
                        .or_else(|| panic.downcast_ref::<&str>().copied())
                        .unwrap_or("(no message)");
                    eprintln!("the run of {name} panicked: {message}");
                    resume_unwind(panic)
                })
            })
            .collect(),
        None => {
            let entry = runs
                .iter()
                .find(|entry| entry.name == name)
                .unwrap_or_else(|| panic!("{name} is not in the table of runs"));
            seeds_of(entry.name)
                .into_iter()
                .map(|seed| run(with_seed((entry.settings)(), seed)))
                .collect()
        }
    };
    for report in &reports {
        report.print_log();
    }
    reports
}

/// The seeds the run test `name` runs: `DLOCK_FAULT_SEED` alone when set,
/// else the test's seeds (`support::seeds`: `tests/seeds.txt`,
/// `DLOCK_SEED`, `DLOCK_FRESH_SEEDS`).
fn seeds_of(name: &str) -> Vec<u64> {
    env_seed("DLOCK_FAULT_SEED").map_or_else(|| seeds(name), |seed| vec![seed])
}

fn with_seed(mut settings: Settings, seed: u64) -> Settings {
    settings.seed = seed;
    settings
}

/// Starts the runs of every selected test of `runs`, one a seed, each in a
/// thread named after its test.
fn launch(runs: &[Entry]) -> Launched {
    let command_line = CommandLine::parse(std::env::args().skip(1));
    let echo =
        command_line.nocapture || std::env::var("RUST_TEST_NOCAPTURE").is_ok_and(|v| v != "0");
    let at_once = std::env::var("DLOCK_FAULT_OVERLAP")
        .ok()
        .and_then(|n| n.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(DEFAULT_AT_ONCE);
    let gate = Arc::new(Gate {
        free: Mutex::new(at_once),
        freed: Condvar::new(),
    });
    // Every selected test's seeds first: a missing one fails here, before
    // any run has started.
    let selected: Vec<(&Entry, Vec<u64>)> = runs
        .iter()
        .filter(|entry| command_line.runs(entry.name))
        .map(|entry| (entry, seeds_of(entry.name)))
        .collect();
    selected
        .into_iter()
        .map(|(entry, seeds)| {
            let handles = seeds
                .into_iter()
                .map(|seed| {
                    let settings = entry.settings;
                    let name = entry.name;
                    let gate = gate.clone();
                    std::thread::Builder::new()
                        .name(entry.name.to_owned())
                        .spawn(move || {
                            let _turn = gate.enter();
                            // Said before the run, so that a run that
                            // panics still names its seed.
                            eprintln!("{name}: seed {seed} (DLOCK_SEED={seed} replays it)");
                            let mut settings = with_seed(settings(), seed);
                            settings.echo = echo;
                            run(settings)
                        })
                        .expect("start a run's thread")
                })
                .collect();
            (entry.name, handles)
        })
        .collect()
}

/// At most so many runs at once.
struct Gate {
    free: Mutex<usize>,
    freed: Condvar,
}

impl Gate {
    fn enter(&self) -> Turn<'_> {
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        while *free == 0 {
            free = self
                .freed
                .wait(free)
                .unwrap_or_else(PoisonError::into_inner);
        }
        *free -= 1;
        Turn(self)
    }
}

/// A run's place at the gate, given back when the run ends (or panics).
struct Turn<'a>(&'a Gate);

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        *self.0.free.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        self.0.freed.notify_one();
    }
}

/// What libtest's command line says about which tests run.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct CommandLine {
    filters: Vec<String>,
    skips: Vec<String>,
    exact: bool,
    /// `--ignored` without `--include-ignored`: only ignored tests run.
    ignored_only: bool,
    nocapture: bool,
}

impl CommandLine {
    /// Reads libtest's arguments (without the program's name). Options
    /// that take a value skip it; after `--` every argument is a filter.
    pub fn parse(args: impl IntoIterator<Item = String>) -> Self {
        /// libtest's options that take a value.
        const WITH_VALUE: [&str; 6] = [
            "--logfile",
            "--test-threads",
            "--color",
            "--format",
            "--shuffle-seed",
            "-Z",
        ];
        let mut line = Self::default();
        let (mut ignored, mut include_ignored) = (false, false);
        let mut args = args.into_iter();
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--" => line.filters.extend(args.by_ref()),
                "--exact" => line.exact = true,
                "--ignored" => ignored = true,
                "--include-ignored" => include_ignored = true,
                "--nocapture" | "--no-capture" => line.nocapture = true,
                "--skip" => line.skips.extend(args.next()),
                _ if arg.starts_with("--skip=") => {
                    line.skips.push(arg["--skip=".len()..].to_owned())
                }
                _ if WITH_VALUE.contains(&arg.as_str()) => {
                    args.next();
                }
                _ if arg.starts_with('-') => {}
                _ => line.filters.push(arg),
            }
        }
        line.ignored_only = ignored && !include_ignored;
        line
    }

    /// Whether libtest runs the (not ignored) test `name`.
    pub fn runs(&self, name: &str) -> bool {
        let matches = |pattern: &String| {
            if self.exact {
                name == pattern
            } else {
                name.contains(pattern.as_str())
            }
        };
        !self.ignored_only
            && (self.filters.is_empty() || self.filters.iter().any(matches))
            && !self.skips.iter().any(matches)
    }
}

#[cfg(test)]
mod tests {
    use super::CommandLine;

    fn line(args: &[&str]) -> CommandLine {
        CommandLine::parse(args.iter().map(|a| (*a).to_owned()))
    }

    #[test]
    fn the_command_line_selects_the_runs_libtest_runs() {
        let redis = "redis_locks_under_pauses";
        let fair_redis = "fair_redis_locks_under_pauses";
        let pg = "pg_locks_under_pauses";
        // No filter: every test; the harness's own flags change nothing.
        let all = line(&[
            "--test-threads",
            "2",
            "--nocapture",
            "-q",
            "--format=pretty",
        ]);
        assert!(all.runs(redis) && all.runs(pg));
        assert!(all.nocapture);
        // Filters match by substring, any of them.
        let some = line(&["redis_locks", "--color", "never"]);
        assert!(some.runs(redis) && some.runs(fair_redis) && !some.runs(pg));
        // A value of an option is no filter.
        assert!(line(&["--test-threads", "2"]).runs(pg));
        // --exact matches whole names, skips included.
        let exact = line(&["--exact", redis, pg, "--skip", pg]);
        assert!(exact.runs(redis) && !exact.runs(fair_redis) && !exact.runs(pg));
        // --skip by substring.
        let skipped = line(&["--skip=fair_", "--skip", "pg_"]);
        assert!(skipped.runs(redis) && !skipped.runs(fair_redis) && !skipped.runs(pg));
        // --ignored alone runs only ignored tests; with --include-ignored
        // everything.
        assert!(!line(&["--ignored", "--exact", "long_run"]).runs(redis));
        assert!(line(&["--ignored", "--include-ignored"]).runs(redis));
        // After --, everything is a filter.
        assert!(!line(&["--", "--exact"]).runs(redis));
    }
}
