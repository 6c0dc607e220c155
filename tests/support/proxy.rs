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
//! prepared), so a test can tell what a backend sends per call.

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
    accept: AbortHandle,
}

/// Client messages of the PostgreSQL protocol, counted by type byte.
type PgCounts = [AtomicUsize; 256];

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
        let accept = tokio::spawn({
            let open = open.clone();
            let replies = replies.clone();
            let pipes = pipes.clone();
            let silenced = silenced.clone();
            let pg_sent = pg_sent.clone();
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
                    let counter = pg_sent.clone().map(PgCounter::new);
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
            accept,
        }
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
    mut counter: Option<PgCounter>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if let Some(counter) = counter.as_mut() {
            counter.feed(&buf[..n]);
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

/// Reads one connection's client stream as PostgreSQL protocol messages
/// and counts them by type. Messages before the startup message (which
/// opens with its protocol version, 3.0) have no type byte: the startup
/// message itself and an SSL or GSS encryption request.
struct PgCounter {
    counts: Arc<PgCounts>,
    started: bool,
    /// The head of the message being read: its type byte (if typed) and
    /// its four length bytes.
    head: Vec<u8>,
    /// What is left of the body of the message being read.
    skip: usize,
}

impl PgCounter {
    fn new(counts: Arc<PgCounts>) -> Self {
        Self {
            counts,
            started: false,
            head: Vec::with_capacity(5),
            skip: 0,
        }
    }

    fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.skip > 0 {
                let n = self.skip.min(bytes.len());
                self.skip -= n;
                bytes = &bytes[n..];
                continue;
            }
            let want = if self.started { 5 } else { 8 };
            let n = (want - self.head.len()).min(bytes.len());
            self.head.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            if self.head.len() < want {
                return;
            }
            let at = if self.started { 1 } else { 0 };
            let len = u32::from_be_bytes(self.head[at..at + 4].try_into().unwrap_or_default());
            if self.started {
                self.counts[usize::from(self.head[0])].fetch_add(1, Ordering::SeqCst);
                self.skip = (len as usize).saturating_sub(4);
            } else {
                let code = u32::from_be_bytes(self.head[4..8].try_into().unwrap_or_default());
                // 3.0: the startup message; anything else asks for
                // encryption (or cancels) and is answered before it.
                self.started = code == 196_608;
                self.skip = (len as usize).saturating_sub(8);
            }
            self.head.clear();
        }
    }
}
