//! What a PostgreSQL row's cycles cost the server: the CPU time (user +
//! system) of the server processes serving the row's connections, which
//! carry an `application_name` of their own. Like the Redis figure of
//! scenario 6, it does not depend on how the client and the server share
//! the machine's cores. It needs the server on this machine: a process
//! that is not there, or is not a `postgres` process (a server in a
//! container reports pids of its own namespace), leaves the figure unknown
//! rather than wrong.

use std::sync::Arc;
use std::time::Duration;

use dlock::pg::tokio_postgres::Client;

use crate::Res;

/// The server processes of one row, found by their `application_name`.
#[derive(Clone)]
pub struct ServerCpu {
    admin: Arc<Client>,
    app: Arc<str>,
}

/// The row's processes and their CPU time at one moment.
pub struct Snapshot {
    pids: Vec<i32>,
    cpu: Duration,
}

impl ServerCpu {
    /// Reads, through `admin` (whose own process is not counted), the
    /// processes whose connections name themselves `app`.
    pub fn new(admin: Arc<Client>, app: &str) -> Self {
        Self {
            admin,
            app: app.into(),
        }
    }

    /// `conn` with this row's `application_name`, which then overrides one
    /// `conn` may set.
    pub fn conn(&self, conn: &str) -> String {
        if conn.starts_with("postgres://") || conn.starts_with("postgresql://") {
            let joint = if conn.contains('?') { '&' } else { '?' };
            format!("{conn}{joint}application_name={}", self.app)
        } else {
            format!("{conn} application_name={}", self.app)
        }
    }

    /// The row's processes now and their CPU time so far; `None` when the
    /// row has none or one cannot be read here.
    pub async fn snapshot(&self) -> Res<Option<Snapshot>> {
        let pids: Vec<i32> = self
            .admin
            .query(
                "SELECT pid FROM pg_stat_activity WHERE application_name = $1",
                &[&&*self.app],
            )
            .await?
            .iter()
            .map(|row| row.try_get(0))
            .collect::<Result<_, _>>()?;
        if pids.is_empty() {
            return Ok(None);
        }
        Ok(cpu_of(&pids).map(|cpu| Snapshot { pids, cpu }))
    }
}

impl Snapshot {
    /// The CPU time the snapshot's processes spent since it was taken;
    /// `None` if one of them ended.
    pub fn elapsed(&self) -> Option<Duration> {
        cpu_of(&self.pids)?.checked_sub(self.cpu)
    }
}

/// The summed CPU time of `pids`, if all are `postgres` processes of this
/// machine: the time on a CPU from `/proc/<pid>/schedstat`, in ns, or
/// where the kernel keeps no such file, utime + stime from
/// `/proc/<pid>/stat`, which the kernel scales to that same time but
/// reports in clock ticks (10 ms).
fn cpu_of(pids: &[i32]) -> Option<Duration> {
    let mut total = Duration::ZERO;
    for pid in pids {
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
        if comm.trim_end() != "postgres" {
            return None;
        }
        total += match std::fs::read_to_string(format!("/proc/{pid}/schedstat")) {
            Ok(schedstat) => {
                Duration::from_nanos(schedstat.split_whitespace().next()?.parse().ok()?)
            }
            Err(_) => stat_time(*pid)?,
        };
    }
    Some(total)
}

/// utime + stime of `pid`.
fn stat_time(pid: i32) -> Option<Duration> {
    // SAFETY: sysconf reads a constant of the system and has no
    // preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let ticks = u64::try_from(ticks).ok().filter(|&t| t > 0)?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command, which is in parentheses and may hold
    // spaces: state is field 3, utime 14 and stime 15.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    Some(Duration::from_micros(
        (field(14)? + field(15)?) * 1_000_000 / ticks,
    ))
}
