//! TLS for the connections of a [`RedisBackend`](crate::redis::RedisBackend):
//! the root certificates to trust, and the refusal of every way a backend
//! could end up talking without the checked TLS it was asked for. Its own
//! file: the one place that decides whether a connection's TLS can be
//! trusted with a lock.

use ::redis::{Client, TlsCertificates};

use crate::error::LockError;

/// Refuses every way a connection could end up without the TLS the
/// caller asked for, or with TLS that does not check whom it talks to;
/// returns whether TLS is used.
///
/// - `rediss://…#insecure` turns redis-rs's certificate check off. A lock
///   is only as safe as its server is genuine: a man in the middle could
///   grant one key to two holders. It is refused rather than warned about
///   (a warning in a log is read after the fact, if ever), and whether
///   redis-rs would honour it depends on a cargo feature any crate in the
///   build can switch on. A private CA goes to
///   [`RedisBuilder::tls_root_certificate`](super::RedisBuilder::tls_root_certificate)
///   instead.
/// - TLS and plain-text URLs mixed: the pub/sub connection (which may use
///   any node) or a cluster seed could talk in the clear.
pub(super) fn check_tls(clients: &[Client], shown: &[String]) -> Result<bool, LockError> {
    use ::redis::ConnectionAddr;
    let refuse = |option, reason| Err(LockError::InvalidOption { option, reason });
    let mut with_tls = Vec::new();
    let mut plain = Vec::new();
    for (client, shown) in clients.iter().zip(shown) {
        match client.get_connection_info().addr() {
            ConnectionAddr::TcpTls { insecure: true, .. } => {
                return refuse(
                    "url",
                    format!(
                        "{shown}: `#insecure` turns off the check of the server's certificate, \
                         which lets a man in the middle hand out locks; dlock refuses it. For a \
                         certificate from a private CA, give the CA to \
                         RedisBuilder::tls_root_certificate"
                    ),
                );
            }
            ConnectionAddr::TcpTls { .. } => with_tls.push(shown.as_str()),
            _ => plain.push(shown.as_str()),
        }
    }
    if !with_tls.is_empty() && !plain.is_empty() {
        return refuse(
            "url",
            format!(
                "{} use TLS but {} would connect in plain text: every node of one backend \
                 must use rediss://, or none",
                with_tls.join(", "),
                plain.join(", ")
            ),
        );
    }
    Ok(!with_tls.is_empty())
}

pub(super) fn tls_certificates(pem: &[u8]) -> TlsCertificates {
    TlsCertificates {
        client_tls: None,
        root_cert: Some(pem.to_vec()),
    }
}
