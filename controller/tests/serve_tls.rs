//! `archipelago serve` under the cluster's mutual TLS (issue 41): with `--tls-cert --tls-key
//! --tls-ca` it listens on https, answers a client whose certificate the cluster CA signed, and
//! gives nothing to a plain-HTTP client or to one whose certificate another CA signed.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use archipelago_actors::trust::certs::make_certs;
use archipelago_actors::trust::{Tls, TlsFiles};

fn fixture(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../integration-tests/fixtures")
        .join(path)
}

fn files(dir: &Path, name: &str) -> TlsFiles {
    TlsFiles {
        cert: dir.join(format!("{name}.pem")),
        key: dir.join(format!("{name}.key")),
        ca: dir.join("ca.pem"),
    }
}

/// Everything `stream` gives until it ends or fails (a TLS peer may close without notice).
fn read_all(mut stream: impl Read) -> String {
    let mut bytes = Vec::new();
    let mut buffer = [0u8; 4096];
    while let Ok(n) = stream.read(&mut buffer) {
        if n == 0 {
            break;
        }
        bytes.extend_from_slice(&buffer[..n]);
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

#[test]
fn serve_over_mutual_tls_answers_only_clients_the_cluster_ca_signed() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("cluster");
    let stranger = dir.path().join("other");
    make_certs(&certs, &["serve".into(), "client".into()], &[]).unwrap();
    make_certs(&stranger, &["client".into()], &[]).unwrap();
    let server = files(&certs, "serve");
    let mut child = Command::new(env!("CARGO_BIN_EXE_archipelago"))
        .args([
            "serve",
            "--init",
            fixture("gpt2/model.safetensors").to_str().unwrap(),
        ])
        .args(["--cache-tokens", "256", "--listen", "127.0.0.1:0"])
        .args([
            "--tls-cert",
            server.cert.to_str().unwrap(),
            "--tls-key",
            server.key.to_str().unwrap(),
        ])
        .args(["--tls-ca", server.ca.to_str().unwrap()])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let addr = stdout.lines().map_while(Result::ok).find_map(|line| {
        let rest = line.strip_prefix("listening on https://")?;
        rest.split_whitespace().next().map(str::to_string)
    });
    let Some(addr) = addr else {
        let _ = child.kill();
        panic!("serve --tls-* ended before listening on https");
    };
    let body = r#"{"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}"#;
    let request = format!(
        "POST /v1/completions HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let ask = |tls: Option<&Tls>| {
        let tcp = TcpStream::connect(&addr).unwrap();
        tcp.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        match tls {
            Some(tls) => match tls.connect_blocking(&addr, tcp) {
                Ok(mut stream) => {
                    let _ = stream.write_all(request.as_bytes());
                    read_all(stream)
                }
                Err(e) => format!("handshake refused: {e}"),
            },
            None => {
                let mut tcp = tcp;
                tcp.write_all(request.as_bytes()).unwrap();
                read_all(tcp)
            }
        }
    };
    let answered = ask(Some(&Tls::load(&files(&certs, "client")).unwrap()));
    let plain = ask(None);
    let foreign = ask(Some(&Tls::load(&files(&stranger, "client")).unwrap()));
    let _ = child.kill();
    let _ = child.wait();
    assert!(answered.starts_with("HTTP/1.0 200"), "{answered}");
    assert!(answered.contains("\"completion_tokens\":4"), "{answered}");
    assert!(!plain.contains("HTTP/1."), "plain HTTP got an answer: {plain}");
    assert!(
        !foreign.contains("HTTP/1."),
        "another CA's client got an answer: {foreign}"
    );
}
