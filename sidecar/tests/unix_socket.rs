//! The sidecar's unix socket (`listen_unix`): served in-process, both HTTP/1.1 and HTTP/2 (h2c
//! with prior knowledge) on it as on TCP, a stale socket file replaced, a live socket or a path
//! that is not a socket refused with a clear error. No Redis needed (`/healthz` answers without).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;
use tollgate_sidecar::config::Config;
use tollgate_sidecar::Sidecar;

fn config(path: &Path) -> Config {
    let mut c = Config { listen: "127.0.0.1:0".parse().unwrap(), listen_unix: Some(path.to_path_buf()), ..Config::default() };
    c.server.secret = tollgate_sidecar::secret::Secret::new("unix-socket-tests-secret");
    c
}

/// Writes `request` on a fresh connection to `path` and returns the first bytes of the answer.
fn exchange(path: &Path, request: &[u8]) -> Vec<u8> {
    let mut s = UnixStream::connect(path).expect("connect to the unix socket");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request).unwrap();
    let mut buf = vec![0u8; 4096];
    let n = s.read(&mut buf).expect("an answer");
    buf.truncate(n);
    buf
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_http1_and_h2c_on_the_socket_and_removes_it_on_a_clean_stop() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sidecar.sock");
    let sidecar = Sidecar::bind(&config(&path)).await.unwrap();
    assert_eq!(sidecar.unix_path(), Some(path.as_path()));
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(sidecar.serve(async move {
        let _ = rx.await;
    }));
    let p = path.clone();
    let (h1, h2) = tokio::task::spawn_blocking(move || {
        let h1 = exchange(&p, b"GET /healthz HTTP/1.1\r\nhost: sidecar\r\nconnection: close\r\n\r\n");
        // The HTTP/2 connection preface, then an empty SETTINGS frame: an h2 server answers with
        // its own SETTINGS frame (type 0x4) first.
        let mut preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        preface.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
        let h2 = exchange(&p, &preface);
        (h1, h2)
    })
    .await
    .unwrap();
    let h1 = String::from_utf8_lossy(&h1);
    assert!(h1.starts_with("HTTP/1.1 200"), "{h1}");
    assert!(h2.len() >= 9 && h2[3] == 4, "not an HTTP/2 SETTINGS frame: {h2:?}");

    tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(20), task).await.expect("a clean stop").unwrap().unwrap();
    assert!(!path.exists(), "the socket file is removed on a clean stop");
}

#[tokio::test]
async fn a_stale_socket_is_replaced_but_a_live_one_or_another_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sidecar.sock");

    // Live: someone accepts on it.
    let live = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let err = Sidecar::bind(&config(&path)).await.err().expect("a live socket must be refused").to_string();
    assert!(err.contains("listen_unix") && err.contains("another process is listening"), "{err}");

    // Stale: the listener is gone, its file is not.
    drop(live);
    assert!(path.exists());
    let sidecar = Sidecar::bind(&config(&path)).await.expect("a stale socket file is replaced");
    drop(sidecar);

    // Not a socket: left alone.
    let file = dir.path().join("notes.txt");
    std::fs::write(&file, "keep me").unwrap();
    let err = Sidecar::bind(&config(&file)).await.err().expect("a regular file must be refused").to_string();
    assert!(err.contains("not a socket"), "{err}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");

    // A directory that does not exist: the bind error, naming the path.
    let missing = dir.path().join("no/such/dir/s.sock");
    let err = Sidecar::bind(&config(&missing)).await.err().expect("an unbindable path must be refused").to_string();
    assert!(err.contains("no/such/dir/s.sock"), "{err}");
}
