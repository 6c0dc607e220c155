//! [`OwnerId`]: the random identity of one acquisition, drawn from a
//! per-thread pool of operating-system randomness that a forked child
//! refills before it hands out an id.

use std::fmt;

use crate::error::{LockError, Operation};

/// Random bytes fetched from the OS at once for [`OwnerId::random`].
const RANDOM_POOL: usize = 512;

struct RandomPool {
    bytes: [u8; RANDOM_POOL],
    used: usize,
    /// The [`forks`] count when the pool was filled: a forked child must
    /// not hand out the ids its parent will hand out too.
    forks: u64,
}

/// How many times this process was forked into the process now running:
/// bumped in the child of every `fork()` (by an `atfork` handler), so
/// that a pool can tell it was copied without a system call per id.
#[cfg(unix)]
pub(crate) fn forks() -> u64 {
    use std::sync::Once;
    use std::sync::atomic::{AtomicU64, Ordering};
    static FORKS: AtomicU64 = AtomicU64::new(0);
    static HANDLER: Once = Once::new();
    extern "C" fn in_child() {
        FORKS.fetch_add(1, Ordering::SeqCst);
    }
    HANDLER.call_once(|| {
        // SAFETY: registers a handler that only bumps an atomic, which is
        // async-signal-safe as a fork handler must be.
        let registered = unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
        assert_eq!(registered, 0, "pthread_atfork failed: {registered}");
    });
    FORKS.load(Ordering::SeqCst)
}

#[cfg(not(unix))]
pub(crate) fn forks() -> u64 {
    0
}

/// The random identity of one acquisition. Release and extend succeed only
/// for the owner that acquired, so a holder whose lease ran out can never
/// release or extend the lease of whoever holds the key now.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct OwnerId([u8; 16]);

impl OwnerId {
    /// 128 fresh random bits from the operating system.
    ///
    /// The bits are drawn from the OS a few hundred at a time into a
    /// per-thread buffer, each handed out once, so that an acquisition does
    /// not pay a system call of its own.
    pub fn random() -> Result<Self, LockError> {
        thread_local! {
            static POOL: std::cell::RefCell<RandomPool> = const {
                std::cell::RefCell::new(RandomPool { bytes: [0; RANDOM_POOL], used: RANDOM_POOL, forks: 0 })
            };
        }
        POOL.with(|pool| {
            let mut pool = pool.borrow_mut();
            let forks = forks();
            if pool.used + 16 > RANDOM_POOL || pool.forks != forks {
                getrandom::fill(&mut pool.bytes).map_err(|e| {
                    LockError::backend("system", Operation::Acquire, "", e.to_string())
                })?;
                pool.used = 0;
                pool.forks = forks;
            }
            let start = pool.used;
            let mut bytes = [0u8; 16];
            bytes.copy_from_slice(&pool.bytes[start..start + 16]);
            // Wiped as handed out: no id can be handed out twice.
            pool.bytes[start..start + 16].fill(0);
            pool.used += 16;
            Ok(Self(bytes))
        })
    }

    /// The 32-hex-digit form written by `Display`, without formatting
    /// machinery: what backends store and send.
    pub fn to_hex(&self) -> [u8; 32] {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut out = [0u8; 32];
        for (i, byte) in self.0.iter().enumerate() {
            out[2 * i] = DIGITS[usize::from(byte >> 4)];
            out[2 * i + 1] = DIGITS[usize::from(byte & 0x0f)];
        }
        out
    }

    /// Rebuilds an owner id from its bytes (as stored by a backend).
    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }

    /// The raw bytes.
    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// Parses the 32-hex-digit form written by `Display`.
    pub fn parse_hex(text: &str) -> Option<Self> {
        if text.len() != 32 || !text.is_ascii() {
            return None;
        }
        let mut bytes = [0u8; 16];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(Self(bytes))
    }
}

impl fmt::Display for OwnerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hex = self.to_hex();
        // Hex digits are ASCII.
        f.write_str(std::str::from_utf8(&hex).unwrap_or_default())
    }
}

impl fmt::Debug for OwnerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OwnerId({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::OwnerId;
    use std::collections::HashSet;

    #[test]
    fn owner_ids_are_distinct_and_round_trip_through_hex() {
        let mut seen = HashSet::new();
        for _ in 0..2000 {
            let id = OwnerId::random().unwrap_or_else(|e| panic!("{e}"));
            assert!(seen.insert(id), "an owner id came out twice");
            let text = id.to_string();
            assert_eq!(text.as_bytes(), id.to_hex());
            assert_eq!(OwnerId::parse_hex(&text), Some(id));
        }
    }

    #[cfg(unix)]
    #[test]
    fn a_forked_child_never_hands_out_the_ids_its_parent_hands_out() {
        // The pool is partly used, so parent and child both start from the
        // same copied bytes unless the child notices the fork.
        let _ = OwnerId::random().unwrap_or_else(|e| panic!("{e}"));
        let mut fds = [0i32; 2];
        // SAFETY: plain pipe/fork/write/_exit; the child touches only the
        // thread-local pool (no allocation) before it exits.
        unsafe {
            assert_eq!(libc::pipe(fds.as_mut_ptr()), 0, "pipe");
            let pid = libc::fork();
            assert!(pid >= 0, "fork");
            if pid == 0 {
                let mut out = [0u8; 64];
                for chunk in out.chunks_mut(16) {
                    match OwnerId::random() {
                        Ok(id) => chunk.copy_from_slice(id.as_bytes()),
                        Err(_) => libc::_exit(1),
                    }
                }
                let written = libc::write(fds[1], out.as_ptr().cast(), out.len());
                libc::_exit(if written == 64 { 0 } else { 1 });
            }
            libc::close(fds[1]);
            let mut child = [0u8; 64];
            let mut got = 0;
            while got < 64 {
                let n = libc::read(fds[0], child[got..].as_mut_ptr().cast(), 64 - got);
                assert!(n > 0, "the child wrote no ids");
                got += n as usize;
            }
            libc::close(fds[0]);
            let mut status = 0;
            libc::waitpid(pid, &mut status, 0);
            assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
            let parent: Vec<[u8; 16]> = (0..4)
                .map(|_| {
                    *OwnerId::random()
                        .unwrap_or_else(|e| panic!("{e}"))
                        .as_bytes()
                })
                .collect();
            for chunk in child.chunks(16) {
                assert!(
                    !parent.iter().any(|p| p.as_slice() == chunk),
                    "the child handed out an id its parent handed out too"
                );
            }
        }
    }
}
