//! A loopback TCP proxy between a client and one server, controlled by the
//! test: open (forwards), frozen (reads and holds the bytes, forwards
//! nothing, keeps every socket open: to both ends it looks like a network
//! that went silent), replies muted (requests reach the server, its replies
//! are dropped: a reply lost on the way back), and cut (closes every
//! connection it carries). Thawing delivers what was held — late, as a
//! congested network would. Silencing is for good and only for the
//! connections open at the time: they carry nothing more, either way, but
//! stay open, while new connections are forwarded (a NAT or load balancer
//! that forgot a connection's state, a peer that lost power).
//!
//! A proxy bound with [`Proxy::bind_pg`] also counts the PostgreSQL
//! protocol messages clients send, by type (`b'P'` for Parse: a statement
//! prepared), so a test can tell what a backend sends per call, and can
//! hold a connection just before it runs a chosen statement
//! ([`Proxy::pause_before`]): what a test needs to act between two
//! statements of one call.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;
use tokio::sync::watch;
use tokio::task::AbortHandle;

pub struct Proxy {
    pub port: u16,
    open: watch::Sender<bool>,
    replies: watch::Sender<bool>,
    pipes: Arc<Mutex<Vec<AbortHandle>>>,
    /// One flag per connection forwarded so far, in the order they were
    /// accepted: set, it carries nothing.
    silenced: Arc<Mutex<Vec<Arc<AtomicBool>>>>,
    /// Client messages by type, if this proxy counts them.
    pg_sent: Option<Arc<PgCounts>>,
    /// The statement to pause before, if any (see [`Proxy::pause_before`]).
    pause: Arc<Pause>,
    accept: AbortHandle,
}

/// Client messages of the PostgreSQL protocol, counted by type byte.
type PgCounts = [AtomicUsize; 256];

/// A pause before the next run of a statement: armed with the start of its
/// text; `held` once a connection waits at it, `go` to let it on.
#[derive(Default)]
struct Pause {
    armed: Mutex<Option<Vec<u8>>>,
    held: tokio::sync::Notify,
    go: tokio::sync::Notify,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `upstream`
    /// (`127.0.0.1:PORT`), on `runtime` (from outside any runtime).
    pub fn start(runtime: &Handle, upstream: String) -> Self {
        let _entered = runtime.enter();
        runtime.block_on(Self::bind(upstream))
    }

    /// [`Proxy::start`] from inside a runtime.
    pub async fn bind(upstream: String) -> Self {
        Self::bind_counting(upstream, None).await
    }

    /// [`Proxy::bind`] for a PostgreSQL server, counting the messages
    /// clients send (see [`Proxy::pg_sent`]).
    pub async fn bind_pg(upstream: String) -> Self {
        let counts: PgCounts = std::array::from_fn(|_| AtomicUsize::new(0));
        Self::bind_counting(upstream, Some(Arc::new(counts))).await
    }

    /// How many messages of type `kind` (`b'P'`: Parse) clients sent
    /// through a proxy bound with [`Proxy::bind_pg`].
    pub fn pg_sent(&self, kind: u8) -> usize {
        self.pg_sent.as_ref().expect("a proxy bound with bind_pg")[usize::from(kind)]
            .load(Ordering::SeqCst)
    }

    async fn bind_counting(upstream: String, pg_sent: Option<Arc<PgCounts>>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let port = listener.local_addr().expect("proxy address").port();
        let (open, _) = watch::channel(true);
        let (replies, _) = watch::channel(true);
        let pipes: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let silenced: Arc<Mutex<Vec<Arc<AtomicBool>>>> = Arc::default();
        let pause: Arc<Pause> = Arc::default();
        let accept = tokio::spawn({
            let open = open.clone();
            let replies = replies.clone();
            let pipes = pipes.clone();
            let silenced = silenced.clone();
            let pg_sent = pg_sent.clone();
            let pause = pause.clone();
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    let silent = Arc::new(AtomicBool::new(false));
                    silenced
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(silent.clone());
                    let Ok(server) = TcpStream::connect(&upstream).await else {
                        continue; // the server is down: the client sees a close
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    // Started under the lock `cut` holds until it has reset
                    // the modes: a connection accepted while the old ones
                    // are cut forwards nothing under the old mode.
                    let mut pipes = pipes.lock().unwrap_or_else(PoisonError::into_inner);
                    let counter = pg_sent
                        .clone()
                        .map(|counts| PgReader::new(counts, pause.clone()));
                    let up = tokio::spawn(pipe(
                        cr,
                        sw,
                        open.subscribe(),
                        None,
                        silent.clone(),
                        counter,
                    ));
                    let down = tokio::spawn(pipe(
                        sr,
                        cw,
                        open.subscribe(),
                        Some(replies.subscribe()),
                        silent,
                        None,
                    ));
                    pipes.retain(|p| !p.is_finished());
                    pipes.push(up.abort_handle());
                    pipes.push(down.abort_handle());
                }
            }
        })
        .abort_handle();
        Self {
            port,
            open,
            replies,
            pipes,
            silenced,
            pg_sent,
            pause,
            accept,
        }
    }

    /// Holds the next connection that is about to run a prepared
    /// statement whose text starts with `text` (a proxy bound with
    /// [`Proxy::bind_pg`]), before its Bind reaches the server; returns
    /// once one waits there. [`Proxy::go`] lets it on.
    pub async fn pause_before(&self, text: &str) {
        assert!(self.pg_sent.is_some(), "a proxy bound with bind_pg");
        let held = self.pause.held.notified();
        *self
            .pause
            .armed
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(text.as_bytes().to_vec());
        held.await;
    }

    /// Lets on the connection [`Proxy::pause_before`] holds.
    pub fn go(&self) {
        self.pause.go.notify_one();
    }

    /// Silences every connection open now, for good: each stays open and
    /// drops what either end sends. New connections are forwarded.
    pub fn silence(&self) {
        self.silence_since(0);
    }

    /// [`Proxy::silence`] for the connections open now that were accepted
    /// after the first `first` (see [`Proxy::connections`]).
    pub fn silence_since(&self, first: usize) {
        let silenced = self.silenced.lock().unwrap_or_else(PoisonError::into_inner);
        for silent in silenced.iter().skip(first) {
            silent.store(true, Ordering::SeqCst);
        }
    }

    /// How many connections the proxy has accepted so far.
    pub fn connections(&self) -> usize {
        self.silenced
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Requests still reach the server; its replies are dropped.
    pub fn mute_replies(&self) {
        self.replies.send_replace(false);
    }

    /// Stops forwarding; connections stay open.
    pub fn freeze(&self) {
        self.open.send_replace(false);
    }

    /// Forwards again, delivering what was held.
    pub fn thaw(&self) {
        self.open.send_replace(true);
    }

    /// Closes every connection (dropping what was held) and forwards new
    /// ones again.
    pub fn cut(&self) {
        let mut pipes = self.pipes.lock().unwrap_or_else(PoisonError::into_inner);
        for pipe in pipes.drain(..) {
            pipe.abort();
        }
        self.open.send_replace(true);
        self.replies.send_replace(true);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// Forwards `from` to `to` while `open`; drops what it reads while
/// `deliver` (if given) is false, and for good once `silent`.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut open: watch::Receiver<bool>,
    deliver: Option<watch::Receiver<bool>>,
    silent: Arc<AtomicBool>,
    mut counter: Option<PgReader>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if let Some(counter) = counter.as_mut()
            && counter.feed(&buf[..n])
        {
            // A statement paused before: what came before it in this read
            // goes on, the rest waits for `go`.
            let pause = counter.pause.clone();
            let go = pause.go.notified();
            pause.held.notify_one();
            go.await;
        }
        if open.wait_for(|open| *open).await.is_err() {
            return;
        }
        if silent.load(Ordering::SeqCst)
            || deliver.as_ref().is_some_and(|deliver| !*deliver.borrow())
        {
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Reads one connection's client stream as PostgreSQL protocol messages,
/// counts them by type, and tells when one is the Bind of a statement
/// [`Proxy::pause_before`] waits for. Messages before the startup message
/// (which opens with its protocol version, 3.0) have no type byte: the
/// startup message itself and an SSL or GSS encryption request.
struct PgReader {
    counts: Arc<PgCounts>,
    pause: Arc<Pause>,
    started: bool,
    /// What is read of the message not yet complete.
    pending: Vec<u8>,
    /// This connection's prepared statements, by name, with their text.
    prepared: Vec<(Vec<u8>, Vec<u8>)>,
}

impl PgReader {
    fn new(counts: Arc<PgCounts>, pause: Arc<Pause>) -> Self {
        Self {
            counts,
            pause,
            started: false,
            pending: Vec::new(),
            prepared: Vec::new(),
        }
    }

    /// Reads `bytes`; true if they hold the Bind of the statement a pause
    /// is armed for (the pause is then used up).
    fn feed(&mut self, bytes: &[u8]) -> bool {
        self.pending.extend_from_slice(bytes);
        let mut paused = false;
        loop {
            let at = usize::from(self.started);
            let Some(len) = self.pending.get(at..at + 4) else {
                return paused;
            };
            let len = u32::from_be_bytes(len.try_into().unwrap_or_default()) as usize;
            let Some(message) = self.pending.get(..at + len) else {
                return paused;
            };
            let message = message.to_vec();
            self.pending.drain(..at + len);
            if !self.started {
                let code = u32::from_be_bytes(message[4..8].try_into().unwrap_or_default());
                // 3.0: the startup message; anything else asks for
                // encryption (or cancels) and is answered before it.
                self.started = code == 196_608;
                continue;
            }
            self.counts[usize::from(message[0])].fetch_add(1, Ordering::SeqCst);
            paused |= self.read(message[0], &message[5..]);
        }
    }

    /// Notes a Parse's statement; true for the Bind of an armed pause's.
    fn read(&mut self, kind: u8, body: &[u8]) -> bool {
        let mut strings = body.split(|&b| b == 0);
        match kind {
            b'P' => {
                if let (Some(name), Some(text)) = (strings.next(), strings.next()) {
                    self.prepared.push((name.to_vec(), text.to_vec()));
                }
                false
            }
            b'B' => {
                let statement = strings.nth(1).unwrap_or_default();
                let text = self
                    .prepared
                    .iter()
                    .rev()
                    .find(|(name, _)| name == statement)
                    .map(|(_, text)| text.as_slice());
                let mut armed = self
                    .pause
                    .armed
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                let hit =
                    matches!((&*armed, text), (Some(start), Some(text)) if text.starts_with(start));
                if hit {
                    *armed = None;
                }
                hit
            }
            _ => false,
        }
    }
}
