//! `tollgate-echo --port P [--host H]`: the demo upstream (echoes requests as JSON) until
//! SIGTERM/SIGINT, on 127.0.0.1 unless `--host` says otherwise (0.0.0.0 in a container: deploy/).

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let port: u16 = match args.iter().position(|a| a == "--port").and_then(|i| args.get(i + 1)) {
        Some(p) => p.parse().map_err(|_| std::io::Error::other("--port must be a number"))?,
        None => return Err(std::io::Error::other("usage: tollgate-echo --port P")),
    };
    let host = args.iter().position(|a| a == "--host").and_then(|i| args.get(i + 1)).map_or("127.0.0.1", |h| h.as_str());
    let listener = tokio::net::TcpListener::bind((host, port)).await?;
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
        }
    };
    tollgate_tests::echo::serve(listener, shutdown).await
}
