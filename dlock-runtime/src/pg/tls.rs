//! TLS for the PostgreSQL connections, through rustls (ring provider): no
//! system OpenSSL is needed to build or run.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

/// How the server's certificate is checked when the connection string asks
/// for TLS (`sslmode=require`, or `prefer` against a server that offers it).
///
/// tokio-postgres understands `sslmode` `disable`, `prefer` and `require`;
/// the checks libpq adds with `verify-ca`/`verify-full` and `sslrootcert`
/// are chosen here instead.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum TlsVerification {
    /// Encrypt, but accept any certificate: what libpq does for `require`
    /// and `prefer` when no root certificate is configured. Protects
    /// against eavesdropping, not against an active man in the middle.
    #[default]
    EncryptOnly,
    /// Check the chain against the Mozilla root store and the host name
    /// against the certificate (libpq's `verify-full` with public CAs).
    PublicRoots,
    /// Check the chain against the CA certificates in this PEM file and the
    /// host name against the certificate (libpq's `verify-full` with
    /// `sslrootcert`).
    RootCertificate(PathBuf),
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
