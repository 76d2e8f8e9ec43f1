//! A cluster CA and per-process certificates for mutual TLS (`archipelago certs`), made with
//! rcgen: ECDSA P-256 keys, each process certificate valid for server and client use, naming
//! the process, `localhost`, 127.0.0.1 and ::1 plus any address the cluster dials it at.
//!
//! An existing CA in the directory (one this command made) is reused, so hosts added later join
//! the same trust; an existing certificate or key is never overwritten.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// What was made: the CA's certificate (new or reused) and one (certificate, key) per name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MadeCerts {
    /// `DIR/ca.pem`.
    pub ca: PathBuf,
    /// Whether the CA was made now (false: an existing one signed the new certificates).
    pub new_ca: bool,
    /// `(DIR/NAME.pem, DIR/NAME.key)` per name, in order.
    pub issued: Vec<(PathBuf, PathBuf)>,
}

/// Makes (or reuses) the CA in `dir` and a certificate per name in `names`, each also valid
/// for `extra_names` (IP addresses or DNS names the process is reached at).
pub fn make_certs(dir: &Path, names: &[String], extra_names: &[String]) -> Result<MadeCerts, String> {
    if names.is_empty() {
        return Err("name at least one process to certify (e.g. --name controller --name host-0)".into());
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let (ca_pem, ca_key) = (dir.join("ca.pem"), dir.join("ca.key"));
    let issued: Vec<(PathBuf, PathBuf)> = names
        .iter()
        .map(|n| {
            if n.is_empty() || n.contains(['/', '\\']) || n.starts_with('.') {
                return Err(format!("{n:?} is not a usable name for a certificate file"));
            }
            Ok((dir.join(format!("{n}.pem")), dir.join(format!("{n}.key"))))
        })
        .collect::<Result<_, String>>()?;
    if let Some(existing) = issued.iter().flat_map(|(c, k)| [c, k]).find(|p| p.exists()) {
        return Err(format!(
            "{} exists: remove it first or pick another name (certificates are never overwritten)",
            existing.display()
        ));
    }
    let new_ca = !ca_pem.exists();
    let issuer = if new_ca {
        let key = KeyPair::generate().map_err(|e| e.to_string())?;
        let params = ca_params()?;
        let cert = params.self_signed(&key).map_err(|e| e.to_string())?;
        write_new(&ca_pem, cert.pem().as_bytes(), false)?;
        write_new(&ca_key, key.serialize_pem().as_bytes(), true)?;
        Issuer::new(params, key)
    } else {
        // The CA's name and key are all a signature needs: a CA this command made is rebuilt
        // from its key (a CA made by other tools signs with those tools).
        let pem =
            std::fs::read_to_string(&ca_key).map_err(|e| format!("cannot read {}: {e}", ca_key.display()))?;
        let key =
            KeyPair::from_pem(&pem).map_err(|e| format!("{}: not a private key: {e}", ca_key.display()))?;
        Issuer::new(ca_params()?, key)
    };
    for (name, (cert_path, key_path)) in names.iter().zip(&issued) {
        let mut alt_names = vec![name.clone(), "localhost".into(), "127.0.0.1".into(), "::1".into()];
        alt_names.extend(extra_names.iter().cloned());
        let mut params =
            CertificateParams::new(alt_names).map_err(|e| format!("certificate names for {name}: {e}"))?;
        params.distinguished_name.push(DnType::CommonName, name.as_str());
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        set_validity(&mut params, 2);
        let key = KeyPair::generate().map_err(|e| e.to_string())?;
        let cert = params.signed_by(&key, &issuer).map_err(|e| e.to_string())?;
        write_new(cert_path, cert.pem().as_bytes(), false)?;
        write_new(key_path, key.serialize_pem().as_bytes(), true)?;
    }
    Ok(MadeCerts {
        ca: ca_pem,
        new_ca,
        issued,
    })
}

/// The cluster CA's parameters (the same on every run, so an existing CA key signs alike).
fn ca_params() -> Result<CertificateParams, String> {
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(|e| e.to_string())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(DnType::CommonName, "archipelago cluster CA");
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    set_validity(&mut params, 10);
    Ok(params)
}

/// From the start of last year (clock skew between hosts) to the end of `years` years from now.
fn set_validity(params: &mut CertificateParams, years: i32) {
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let year = 1970 + (seconds / 31_556_952) as i32;
    params.not_before = rcgen::date_time_ymd(year - 1, 1, 1);
    params.not_after = rcgen::date_time_ymd(year + years, 12, 31);
}

/// Writes a file that must not exist yet; keys are readable by their owner only.
fn write_new(path: &Path, bytes: &[u8], secret: bool) -> Result<(), String> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    #[cfg(not(unix))]
    let _ = secret;
    options
        .open(path)
        .and_then(|mut f| f.write_all(bytes))
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}
