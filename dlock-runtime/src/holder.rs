//! Who holds a lock: the host, process id and application label every
//! acquisition records beside the lock, and how long it has held it.
//!
//! A refused caller reads it in its [`LockError::Held`], an operator with
//! the `dlock` command-line inspector, and code with [`Backend::holder`]
//! and [`Backend::held`]. Every in-tree backend keeps the record in the
//! same atomic step that takes the key, next to the lock itself (see each
//! backend's module for where), and times the hold with the store's own
//! clock, so the age a reader sees does not depend on the reader's clock.
//!
//! The label names the application (`"billing"`). It is set for the whole
//! process with [`Registry::set_label`](crate::Registry::set_label), and a
//! backend may carry one of its own, which wins.
//!
//! [`LockError::Held`]: crate::LockError::Held
//! [`Backend::holder`]: crate::Backend::holder
//! [`Backend::held`]: crate::Backend::held

use std::fmt;
use std::sync::{LazyLock, PoisonError, RwLock};
use std::time::Duration;

use crate::error::LockError;

/// The longest application label, in bytes.
pub const MAX_LABEL_LEN: usize = 64;

/// The version tag that starts an encoded record ([`HolderInfo::encode`]).
const RECORD_VERSION: &str = "1";

/// Who holds a lock, as its acquisition recorded it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HolderInfo {
    /// The host name of the holder's machine (or container).
    pub host: String,
    /// The holder's process id on that host.
    pub pid: u32,
    /// The application label the holder's process or backend set, if any.
    pub label: Option<String>,
    /// How long ago the lock was taken, by the store's clock, when the
    /// store keeps the time of acquisition.
    pub held_for: Option<Duration>,
}

impl HolderInfo {
    /// This process, with `label`: what an acquisition records.
    pub fn this_process(label: Option<&str>) -> Self {
        Self {
            host: HOST.clone(),
            pid: std::process::id(),
            label: label.map(str::to_owned),
            held_for: None,
        }
    }

    /// The same holder, who has held the lock for `held_for`.
    pub fn held_for(mut self, held_for: Duration) -> Self {
        self.held_for = Some(held_for);
        self
    }

    /// The record a store keeps: `1`, the host, the pid and the label,
    /// separated by tabs (an empty label for none). Neither the host nor
    /// the label can hold a tab or any other control character: the host
    /// has them replaced by `?`, and labels are checked when they are set
    /// ([`check_label`]). The time of acquisition is the store's to keep.
    pub fn encode(&self) -> String {
        let label = self.label.as_deref().unwrap_or("");
        format!("{RECORD_VERSION}\t{}\t{}\t{label}", self.host, self.pid)
    }

    /// Reads a record [`HolderInfo::encode`] wrote; `None` for anything
    /// else (a record of a later version, a damaged one).
    pub fn decode(record: &str) -> Option<Self> {
        let mut fields = record.splitn(4, '\t');
        if fields.next()? != RECORD_VERSION {
            return None;
        }
        let host = fields.next()?;
        let pid = fields.next()?.parse().ok()?;
        let label = fields.next()?;
        // Whoever can write to the store can write a record: no control
        // character (a terminal or log escape) gets into a message.
        if host.is_empty() || host.contains(char::is_control) || label.contains(char::is_control) {
            return None;
        }
        Some(Self {
            host: host.to_owned(),
            pid,
            label: (!label.is_empty()).then(|| label.to_owned()),
            held_for: None,
        })
    }
}

/// `web-3 (pid 4121, label "billing")`.
impl fmt::Display for HolderInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (pid {}", self.host, self.pid)?;
        if let Some(label) = &self.label {
            write!(f, ", label {label:?}")?;
        }
        f.write_str(")")
    }
}

/// Checks an application label: at most [`MAX_LABEL_LEN`] bytes, not
/// empty, no control characters.
pub fn check_label(label: &str) -> Result<(), LockError> {
    let reason = if label.is_empty() {
        "it is empty".to_owned()
    } else if label.len() > MAX_LABEL_LEN {
        format!(
            "it is {} bytes long; the limit is {MAX_LABEL_LEN}",
            label.len()
        )
    } else if label.contains(char::is_control) {
        "it contains a control character".to_owned()
    } else {
        return Ok(());
    };
    Err(LockError::InvalidOption {
        option: "label",
        reason,
    })
}

/// The label set for the whole process ([`crate::Registry::set_label`]).
static PROCESS_LABEL: RwLock<Option<std::sync::Arc<str>>> = RwLock::new(None);

pub(crate) fn set_process_label(label: Option<&str>) -> Result<(), LockError> {
    if let Some(label) = label {
        check_label(label)?;
    }
    *PROCESS_LABEL
        .write()
        .unwrap_or_else(PoisonError::into_inner) = label.map(Into::into);
    Ok(())
}

pub(crate) fn process_label() -> Option<std::sync::Arc<str>> {
    PROCESS_LABEL
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
}

/// This machine's host name, read once, with control characters replaced
/// (a record is tab-separated); `unknown` if it cannot be read.
static HOST: LazyLock<String> = LazyLock::new(|| {
    let name = read_host_name().unwrap_or_default();
    let name: String = name
        .trim()
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    if name.is_empty() {
        "unknown".to_owned()
    } else {
        name
    }
});

#[cfg(unix)]
fn read_host_name() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname writes at
    // most that many bytes.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Some(String::from_utf8_lossy(&buf[..end]).into_owned())
}

#[cfg(not(unix))]
fn read_host_name() -> Option<String> {
    std::env::var("COMPUTERNAME").ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_back_as_written() {
        let info = HolderInfo {
            host: "web-3".into(),
            pid: 4121,
            label: Some("billing team".into()),
            held_for: None,
        };
        assert_eq!(HolderInfo::decode(&info.encode()), Some(info.clone()));
        let unlabelled = HolderInfo {
            label: None,
            ..info
        };
        assert_eq!(
            HolderInfo::decode(&unlabelled.encode()),
            Some(unlabelled.clone())
        );
    }

    #[test]
    fn a_record_of_another_version_or_shape_reads_as_none() {
        for record in [
            "",
            "2\tweb\t1\t",
            "1\tweb\tx\t",
            "1\tweb",
            "1\t\t1\t",
            "1\tweb\x1b[2J\t1\t",
            "1\tweb\t1\tbill\x1b]0;x\x07",
        ] {
            assert_eq!(HolderInfo::decode(record), None, "{record:?}");
        }
    }

    #[test]
    fn this_process_names_this_host_and_pid() {
        let me = HolderInfo::this_process(Some("x"));
        assert_eq!(me.pid, std::process::id());
        assert!(!me.host.is_empty() && !me.host.contains(char::is_control));
        assert_eq!(me.label.as_deref(), Some("x"));
    }

    #[test]
    fn a_label_with_a_control_character_or_too_long_is_refused() {
        assert!(check_label("billing").is_ok());
        for bad in ["", "a\tb", "a\nb", &"x".repeat(MAX_LABEL_LEN + 1)] {
            assert!(
                matches!(
                    check_label(bad),
                    Err(LockError::InvalidOption {
                        option: "label",
                        ..
                    })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn it_displays_host_pid_and_label() {
        let info = HolderInfo {
            host: "web-3".into(),
            pid: 4121,
            label: Some("billing".into()),
            held_for: None,
        };
        assert_eq!(info.to_string(), "web-3 (pid 4121, label \"billing\")");
    }
}
