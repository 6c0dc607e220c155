//! TLS for the PostgreSQL connections, through rustls (ring provider): no
//! system OpenSSL is needed to build or run.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres::Config;
use tokio_postgres::config::SslMode;
use tokio_postgres_rustls::MakeRustlsConnect;

/// How the server's certificate is checked.
///
/// tokio-postgres understands `sslmode` `disable`, `prefer` (its default)
/// and `require`; the checks libpq adds with `verify-ca`/`verify-full` and
/// `sslrootcert` are chosen here instead.
///
/// Asking for a check means asking for TLS: with [`PublicRoots`] or
/// [`RootCertificate`], `sslmode=prefer` (or no `sslmode`) acts as
/// `require`, so a man in the middle that answers the TLS request with "no"
/// gets no session at all instead of a plain-text one. An explicit
/// `sslmode=disable` beside a check is a contradiction and refused at
/// connect ([`LockError::InvalidOption`](crate::LockError::InvalidOption)).
///
/// [`PublicRoots`]: TlsVerification::PublicRoots
/// [`RootCertificate`]: TlsVerification::RootCertificate
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum TlsVerification {
    /// Encrypt when TLS is used, but accept any certificate: what libpq does
    /// for `sslmode=prefer` and `require`. This protects against
    /// eavesdropping only, **not against a man in the middle**: with
    /// `prefer` (the default) one can decline TLS and read the session in
    /// plain text, and with `require` one can present a certificate of its
    /// own. Choose [`PublicRoots`](TlsVerification::PublicRoots) or
    /// [`RootCertificate`](TlsVerification::RootCertificate) to stop that.
    #[default]
    EncryptOnly,
    /// Require TLS; check the chain against the Mozilla root store and the
    /// host name against the certificate (libpq's `verify-full` with public
    /// CAs).
    PublicRoots,
    /// Require TLS; check the chain against the CA certificates in this PEM
    /// file and the host name against the certificate (libpq's
    /// `verify-full` with `sslrootcert`).
    RootCertificate(PathBuf),
}

impl TlsVerification {
    /// True when the server's certificate is checked.
    fn verifies(&self) -> bool {
        match self {
            TlsVerification::EncryptOnly => false,
            TlsVerification::PublicRoots | TlsVerification::RootCertificate(_) => true,
        }
    }

    /// The variant's name, for messages.
    fn name(&self) -> &'static str {
        match self {
            TlsVerification::EncryptOnly => "EncryptOnly",
            TlsVerification::PublicRoots => "PublicRoots",
            TlsVerification::RootCertificate(_) => "RootCertificate",
        }
    }
}

/// Makes `config` require TLS when `verification` checks the certificate:
/// under `sslmode=prefer` a server (or a man in the middle) that declines
/// TLS would otherwise get a plain-text session, and the certificate the
/// caller asked to check would never be looked at. Returns why when the
/// connection string rules TLS out (`sslmode=disable`).
pub(super) fn require_when_verifying(
    config: &mut Config,
    verification: &TlsVerification,
) -> Result<(), String> {
    if !verification.verifies() {
        return Ok(());
    }
    match config.get_ssl_mode() {
        SslMode::Require => Ok(()),
        SslMode::Disable => Err(format!(
            "TlsVerification::{} asks to verify the server's certificate, but the connection \
             string says sslmode=disable (no TLS, so no certificate to verify); remove \
             sslmode=disable or use sslmode=require",
            verification.name()
        )),
        // `prefer`, and any mode tokio-postgres may add: nothing weaker
        // than `require` may stand beside a check.
        _ => {
            config.ssl_mode(SslMode::Require);
            Ok(())
        }
    }
}

/// Builds the connector for `verification`.
pub(super) fn connector(verification: &TlsVerification) -> Result<MakeRustlsConnect, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup failed: {e}"))?;
    let config = match verification {
        TlsVerification::EncryptOnly => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(EncryptOnly {
                algorithms: provider.signature_verification_algorithms,
            }))
            .with_no_client_auth(),
        TlsVerification::PublicRoots => builder
            .with_root_certificates(RootCertStore {
                roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
            })
            .with_no_client_auth(),
        TlsVerification::RootCertificate(path) => builder
            .with_root_certificates(roots_from_pem(path)?)
            .with_no_client_auth(),
    };
    Ok(MakeRustlsConnect::new(config))
}

fn roots_from_pem(path: &Path) -> Result<RootCertStore, String> {
    let shown = path.display();
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("cannot read root certificate file {shown}: {e}"))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("cannot parse root certificate file {shown}: {e}"))?;
    let mut roots = RootCertStore::empty();
    let (added, _ignored) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(format!(
            "root certificate file {shown} holds no usable CA certificate"
        ));
    }
    Ok(roots)
}

/// Accepts any certificate but still checks the handshake signatures, so
/// the session is encrypted to whoever holds the certificate's key.
#[derive(Debug)]
struct EncryptOnly {
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for EncryptOnly {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}
