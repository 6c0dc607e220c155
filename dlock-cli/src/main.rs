//! `dlock`: looks into a dlock backend from the command line.
//!
//! ```text
//! dlock --backend URL list [PREFIX]        the held keys and their holders
//! dlock --backend URL show KEY             who holds one key
//! dlock --backend URL release KEY --force  breaks the lock it shows, after asking
//! dlock --backend URL watch KEY            every acquisition and release
//! ```
//!
//! Each takes `--json`; a failure then also prints `{"error": …,
//! "exit_status": …}` on stdout. The exit status is 0 on success (and for
//! `watch` stopped with Ctrl-C, its normal end), 1 on an error (or a
//! refusal, or a release whose holder changed), 2 on a usage error (a key no lock can have included), and 3
//! when `show` or `release` finds the key free, so a script can tell "free"
//! from "could not ask".

mod connect;
mod output;

use std::fmt;
use std::io::{self, BufRead, IsTerminal, Write};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use clap::{Parser, Subcommand};
use dlock::backend::{ForceRelease, Holding};
use dlock::{Backend, FencingToken, LockError, LockKey};

use output::{
    HoldingView, ListView, LockView, ReleaseView, ShowView, WatchEvent, json_line, printable,
};

/// Exit status: `show` or `release` found the key free.
const NOT_HELD: u8 = 3;
/// Exit status: an error, or a release that was refused or declined, or
/// whose holder changed.
const FAILED: u8 = 1;
/// Exit status: the command line is wrong (as clap's own errors).
const USAGE: u8 = 2;

const AFTER_HELP: &str = "\
Exit status: 0 success; 1 error, or a release refused, declined or whose holder
changed (nothing released); 2 usage error; 3 the key is not held (show, release).

The backend URL may carry a password: prefer DLOCK_BACKEND to --backend, which
other users can read in the process list. dlock never prints it.";

/// Looks into the locks of a dlock backend: who holds what, since when,
/// until when; breaks a lock whose holder is stuck.
#[derive(Debug, Parser)]
#[command(name = "dlock", version, after_help = AFTER_HELP)]
struct Cli {
    /// Where the locks are: redis://…, rediss://…,
    /// redis+sentinel://h1,h2/name, postgresql://… (or key=value: "host=db
    /// user=app dbname=app"), or file:///dir
    #[arg(
        long,
        short = 'b',
        env = "DLOCK_BACKEND",
        hide_env_values = true,
        value_name = "URL"
    )]
    backend: String,

    /// Print JSON: one document (list, show, release), one object a line (watch)
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List the held keys that start with PREFIX (every held key without it)
    List {
        /// Only keys that start with this
        #[arg(default_value = "")]
        prefix: String,
    },
    /// Show who holds KEY (exit status 3 when nobody does)
    Show {
        /// The lock key
        key: String,
    },
    /// Release KEY held by the holder it names; its holder sees its lease lost
    ///
    /// It names the holder it read (or the lease `--token` names) and
    /// breaks only that lease: if another holds the key by then, nothing is
    /// released and the exit status is 1. The holder finds out at its next
    /// renewal and stops. On PostgreSQL the holder's database session is
    /// ended, which releases every lock that session holds, and the holder
    /// is told at once.
    Release {
        /// The lock key
        key: String,
        /// Needed: this breaks a lock another process holds
        #[arg(long)]
        force: bool,
        /// Do not ask for confirmation (needed when stdin is not a terminal)
        #[arg(long, short = 'y')]
        yes: bool,
        /// Break the lock only if it is held by the lease with this fencing
        /// token (as `show` prints it), not whichever holds it now
        #[arg(long, value_name = "TOKEN")]
        token: Option<u64>,
    },
    /// Print every acquisition and release of KEY until Ctrl-C
    Watch {
        /// The lock key
        key: String,
        /// Read the key at least this often, for changes the store does
        /// not announce (a lock taken on Redis is not); at least 100ms
        #[arg(long, default_value = "1s", value_parser = parse_every, value_name = "DURATION")]
        every: Duration,
    },
}

/// Why a command did not succeed: what to print and the exit status.
#[derive(Debug)]
pub struct Failure {
    message: String,
    code: u8,
}

impl Failure {
    /// An error: exit status 1.
    pub fn error(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            code: FAILED,
        }
    }

    /// A wrong command line: exit status 2.
    pub fn usage(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            code: USAGE,
        }
    }

    /// Ended without output on stdout's reader: nothing to say.
    fn quiet() -> Self {
        Self {
            message: String::new(),
            code: 0,
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// The runtime's errors say what failed and to which key, and hide the
/// credentials of the URLs they name; their text includes their source's.
impl From<LockError> for Failure {
    fn from(err: LockError) -> Self {
        Self::error(err.to_string())
    }
}

/// A reader that went away (`dlock list | head`) ends the command quietly.
impl From<io::Error> for Failure {
    fn from(err: io::Error) -> Self {
        if err.kind() == io::ErrorKind::BrokenPipe {
            Self::quiet()
        } else {
            Self::error(format!("cannot write the output: {err}"))
        }
    }
}

/// The shortest `watch --every`: a shorter one would read the store in a
/// busy loop.
const MIN_EVERY: Duration = Duration::from_millis(100);

fn parse_every(text: &str) -> Result<Duration, String> {
    let every = humantime::parse_duration(text).map_err(|err| err.to_string())?;
    if every < MIN_EVERY {
        return Err(format!(
            "{text} is too short: at least {} (a shorter one reads the store in a busy loop)",
            humantime::format_duration(MIN_EVERY)
        ));
    }
    Ok(every)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let json = cli.json;
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("dlock: cannot start: {err}");
            return ExitCode::from(FAILED);
        }
    };
    let code = match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(failure) => {
            if !failure.message.is_empty() {
                eprintln!("dlock: {failure}");
                if json {
                    // A script reading stdout gets a document for the
                    // failure too, not nothing.
                    let document = output::ErrorView {
                        error: &failure.message,
                        exit_status: failure.code,
                    };
                    let _ = json_line(&mut io::stdout().lock(), &document);
                }
            }
            failure.code
        }
    };
    // Background tasks of the backend (a pub/sub link, sessions) are not
    // waited for: the process is done.
    runtime.shutdown_background();
    ExitCode::from(code)
}

async fn run(cli: Cli) -> Result<u8, Failure> {
    // Checked before connecting: a bad key or a missing --force costs no
    // connection.
    let key = match &cli.command {
        Command::List { .. } => None,
        Command::Show { key } | Command::Release { key, .. } | Command::Watch { key, .. } => {
            // A key no lock can have is the command line's fault: status 2.
            Some(LockKey::new(key.as_str()).map_err(|err| Failure::usage(err.to_string()))?)
        }
    };
    if let Command::Release { force: false, .. } = cli.command {
        return Err(Failure::usage(
            "release breaks a lock another process holds: add --force to do it",
        ));
    }
    let backend = connect::connect(&cli.backend).await?;
    let json = cli.json;
    match (cli.command, key) {
        (Command::List { prefix }, _) => list(&*backend, &prefix, json).await,
        (Command::Show { .. }, Some(key)) => show(&*backend, &key, json).await,
        (Command::Release { yes, token, .. }, Some(key)) => {
            release(&*backend, &key, yes, token.map(FencingToken::new), json).await
        }
        (Command::Watch { every, .. }, Some(key)) => {
            tokio::select! {
                result = watch(backend, &key, every, json) => result,
                _ = tokio::signal::ctrl_c() => Ok(0),
            }
        }
        (_, None) => Err(Failure::error("no key")),
    }
}

async fn list(backend: &dyn Backend, prefix: &str, json: bool) -> Result<u8, Failure> {
    let locks: Vec<LockView> = backend
        .held(prefix)
        .await?
        .into_iter()
        .map(|(key, holding)| LockView {
            key,
            holding: HoldingView::of(&holding),
        })
        .collect();
    let mut out = io::stdout().lock();
    if json {
        let view = ListView {
            prefix: prefix.to_owned(),
            locks,
        };
        json_line(&mut out, &view)?;
    } else if locks.is_empty() && prefix.is_empty() {
        writeln!(out, "No lock is held.")?;
    } else if locks.is_empty() {
        writeln!(out, "No lock is held under `{}`.", printable(prefix))?;
    } else {
        out.write_all(output::list_table(&locks).as_bytes())?;
    }
    Ok(0)
}

async fn show(backend: &dyn Backend, key: &LockKey, json: bool) -> Result<u8, Failure> {
    let holding = backend.holder(key).await?.as_ref().map(HoldingView::of);
    let mut out = io::stdout().lock();
    if json {
        let view = ShowView {
            key: key.to_string(),
            held: holding.is_some(),
            holding: holding.clone(),
        };
        json_line(&mut out, &view)?;
    } else {
        match &holding {
            Some(h) => out.write_all(output::show_text(key.as_str(), h).as_bytes())?,
            None => writeln!(out, "`{}` is free.", printable(key.as_str()))?,
        }
    }
    Ok(if holding.is_some() { 0 } else { NOT_HELD })
}

/// Breaks the lease on `key` that it names, and only that one: the one
/// whose token `--token` gives, else the holder it reads first and shows.
/// The backend compares and breaks in one step
/// ([`Backend::force_release_holding`]), so a holder that changed since it
/// was read (while the operator answered, say) is never broken instead.
/// On a key held as permits only the permit named is broken (or the
/// backend refuses, breaking nothing), and the message says the key is
/// still held by the others.
async fn release(
    backend: &dyn Backend,
    key: &LockKey,
    yes: bool,
    token: Option<FencingToken>,
    json: bool,
) -> Result<u8, Failure> {
    let shown = printable(key.as_str());
    let pg = backend.kind() == "pg";
    let Some(read) = backend.holder(key).await? else {
        return not_released(
            key,
            json,
            format!("`{shown}` is not held: nothing to release."),
        );
    };
    let holding = HoldingView::of(&read);
    let Some(named) = token.or(read.token) else {
        return Err(Failure::error(format!(
            "not releasing `{shown}`: it is held by {}, with no fencing token to name that \
             lease by, so dlock cannot make sure it breaks only that one",
            holding.holder_text()
        )));
    };
    // A `--token` may name another lease than the one read (another
    // permit of the key, say), which the backend may break: asked all the
    // same, naming that token.
    let named_shown = read.token == Some(named);
    if !yes {
        if !io::stdin().is_terminal() {
            return Err(Failure::error(format!(
                "not releasing `{shown}`: there is no terminal to ask for confirmation on \
                 (stdin is not a terminal); add --yes to release it without asking"
            )));
        }
        let mut question = String::new();
        if pg {
            question.push_str(
                "On PostgreSQL this ends the holder's database session: every lock that \
                 session holds is released with it, and the holder is told at once.\n",
            );
        }
        question.push_str(&if named_shown {
            format!(
                "Release lock `{shown}` held by {}, token {named}? [y/N] ",
                holding.holder_text()
            )
        } else {
            format!(
                "Release the lease with token {named} on `{shown}` (the holder read now is {}, \
                 token {})? [y/N] ",
                holding.holder_text(),
                read.token
                    .map_or_else(|| "unknown".to_owned(), |t| t.to_string())
            )
        });
        if !confirm(question).await? {
            return Err(Failure::error(format!("`{shown}` was not released.")));
        }
    }
    match backend
        .force_release_holding(key, &Holding::new(Some(named), None))
        .await?
    {
        ForceRelease::Released => {}
        ForceRelease::NotHeld => {
            return not_released(
                key,
                json,
                format!("`{shown}` was released by its holder meanwhile: nothing to release."),
            );
        }
        // `HolderChanged`, and any answer a later version adds.
        _ => {
            return Err(Failure::error(format!(
                "the holder of `{shown}` changed: nothing was released (the lease with token \
                 {named} no longer holds it); see who holds it now with `dlock show`"
            )));
        }
    }
    // Only the lease named is broken: a key held as permits (or by a
    // phase of shared holders another read named) may still be held by
    // its other leases, and the operator is told so rather than that the
    // key is free. A failed read only leaves the note out.
    let still = match backend.holder(key).await {
        Ok(Some(now)) if now.token != Some(named) => Some(HoldingView::of(&now).holder_text()),
        _ => None,
    };
    let mut out = io::stdout().lock();
    if json {
        let view = ReleaseView {
            key: key.to_string(),
            released: true,
            holding: Some(holding),
        };
        json_line(&mut out, &view)?;
    } else {
        let consequence = if pg {
            "Its PostgreSQL session was ended: the holder is told at once, and every lock \
             of that session is released."
        } else {
            "The holder sees its lease lost at its next renewal."
        };
        match still {
            None => writeln!(
                out,
                "Released `{shown}`, held by {}, token {named}. {consequence}",
                holding.holder_text()
            )?,
            Some(other) => writeln!(
                out,
                "Released the lease with token {named} on `{shown}`, held by {}. {consequence} \
                 Only that lease was broken: `{shown}` is still held, by {other} (its other \
                 permits are kept).",
                holding.holder_text()
            )?,
        }
    }
    Ok(0)
}

/// `release` found nothing to release: exit status 3.
fn not_released(key: &LockKey, json: bool, message: String) -> Result<u8, Failure> {
    let mut out = io::stdout().lock();
    if json {
        let view = ReleaseView {
            key: key.to_string(),
            released: false,
            holding: None,
        };
        json_line(&mut out, &view)?;
    } else {
        writeln!(out, "{message}")?;
    }
    Ok(NOT_HELD)
}

/// Asks `question` on stderr (stdout may be a pipe) and reads the answer
/// from the terminal: yes only for `y` or `yes`.
async fn confirm(question: String) -> Result<bool, Failure> {
    let answer = tokio::task::spawn_blocking(move || -> io::Result<String> {
        let mut err = io::stderr().lock();
        err.write_all(question.as_bytes())?;
        err.flush()?;
        let mut answer = String::new();
        io::stdin().lock().read_line(&mut answer)?;
        Ok(answer)
    })
    .await
    .map_err(|err| Failure::error(format!("cannot ask for confirmation: {err}")))?
    .map_err(|err| Failure::error(format!("cannot read the answer: {err}")))?;
    Ok(matches!(
        answer.trim().to_ascii_lowercase().as_str(),
        "y" | "yes"
    ))
}

/// Added to the holder's ttl before looking again, so the read after an
/// expiry finds it expired.
const EXPIRY_SLACK: Duration = Duration::from_millis(2);

/// Prints the key's state, then every change, until it is stopped. The
/// notice is registered before each read (`watch_holder`, then `holder`):
/// a change after the read wakes it, so none is missed. Between notices
/// it reads again when the holder's ttl runs out, when the notice asks
/// (`recheck_within`), and at least every `every`, for changes the store
/// does not announce.
async fn watch(
    backend: Arc<dyn Backend>,
    key: &LockKey,
    every: Duration,
    json: bool,
) -> Result<u8, Failure> {
    // `None` before the first read; then the lease last seen, if any.
    let mut last: Option<Option<HoldingView>> = None;
    loop {
        let read = async {
            let notice = backend.watch_holder(key).await?;
            let holding = backend.holder(key).await?;
            Ok::<_, LockError>((notice, holding.as_ref().map(HoldingView::of)))
        };
        let (notice, now) = match read.await {
            Ok(read) => read,
            // The first read failing is an answer: the watch cannot start.
            Err(err) if last.is_none() => return Err(err.into()),
            // Later, a store that is away for a while is waited out.
            Err(err) => {
                eprintln!("dlock: {err} (trying again in {})", output::duration(every));
                tokio::time::sleep(every).await;
                continue;
            }
        };
        for (event, holding) in changes(last.as_ref(), now.as_ref()) {
            let line = WatchEvent {
                at: humantime::format_rfc3339_millis(SystemTime::now()).to_string(),
                event,
                key: key.to_string(),
                holding,
            };
            let mut out = io::stdout().lock();
            if json {
                json_line(&mut out, &line)?;
            } else {
                out.write_all(output::watch_text(&line).as_bytes())?;
                out.flush()?;
            }
        }
        let ttl_left = now
            .as_ref()
            .and_then(|h| h.ttl_left_ms)
            .map(|ms| Duration::from_millis(ms) + EXPIRY_SLACK);
        last = Some(now);
        let nap = [ttl_left, notice.recheck()]
            .into_iter()
            .flatten()
            .fold(every, Duration::min);
        let _ = tokio::time::timeout(nap, notice).await;
    }
}

/// The lines a new reading makes: the state at the first, then a release
/// and an acquisition (a new holder between two reads makes both). A
/// release names the lease that ended, without the times of its last
/// reading, which no longer hold.
fn changes(
    last: Option<&Option<HoldingView>>,
    now: Option<&HoldingView>,
) -> Vec<(&'static str, Option<HoldingView>)> {
    let ended = |was: &HoldingView| HoldingView {
        held_for_ms: None,
        ttl_left_ms: None,
        ..was.clone()
    };
    match (last, now) {
        (None, Some(now)) => vec![("held", Some(now.clone()))],
        (None, None) => vec![("free", None)],
        (Some(None), Some(now)) => vec![("acquired", Some(now.clone()))],
        (Some(Some(was)), None) => vec![("released", Some(ended(was)))],
        (Some(Some(was)), Some(now)) if !was.same_lease(now) => {
            vec![
                ("released", Some(ended(was))),
                ("acquired", Some(now.clone())),
            ]
        }
        (Some(_), _) => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(token: u64, pid: u32) -> HoldingView {
        HoldingView {
            token: Some(token),
            identity: None,
            host: Some("web-3".into()),
            pid: Some(pid),
            label: None,
            held_for_ms: Some(1),
            ttl_left_ms: Some(2),
        }
    }

    fn events(last: Option<&Option<HoldingView>>, now: Option<&HoldingView>) -> Vec<String> {
        changes(last, now)
            .into_iter()
            .map(|(event, h)| {
                let times = h.as_ref().map(|h| (h.held_for_ms, h.ttl_left_ms));
                let token = h.and_then(|h| h.token).unwrap_or(0);
                if event == "released" {
                    assert_eq!(times, Some((None, None)), "a release carries no times");
                }
                format!("{event}{token}")
            })
            .collect::<Vec<_>>()
    }

    #[test]
    fn a_watch_reports_the_state_first_then_each_change() {
        let a = lease(5, 10);
        let mut a_later = lease(5, 10);
        a_later.held_for_ms = Some(900);
        a_later.ttl_left_ms = Some(7);
        let b = lease(6, 11);
        assert_eq!(events(None, None), ["free0"]);
        assert_eq!(events(None, Some(&a)), ["held5"]);
        assert_eq!(events(Some(&None), Some(&a)), ["acquired5"]);
        assert_eq!(events(Some(&Some(a.clone())), None), ["released5"]);
        assert!(events(Some(&Some(a.clone())), Some(&a_later)).is_empty());
        assert!(events(Some(&None), None).is_empty());
        assert_eq!(events(Some(&Some(a)), Some(&b)), ["released5", "acquired6"]);
    }

    #[test]
    fn the_command_line_parses_as_the_design_writes_it() {
        let cli = Cli::try_parse_from([
            "dlock",
            "--backend",
            "redis://h",
            "release",
            "k",
            "--force",
            "--json",
        ]);
        assert!(matches!(
            cli.map(|c| (c.json, c.command)),
            Ok((
                true,
                Command::Release {
                    force: true,
                    yes: false,
                    ..
                }
            ))
        ));
        let cli =
            Cli::try_parse_from(["dlock", "-b", "file:///d", "watch", "k", "--every", "250ms"]);
        assert!(matches!(
            cli.map(|c| c.command),
            Ok(Command::Watch { every, .. }) if every == Duration::from_millis(250)
        ));
    }

    #[test]
    fn clap_finds_no_fault_in_the_command() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
