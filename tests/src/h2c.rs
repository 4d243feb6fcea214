//! HTTP/2 over cleartext (prior knowledge) to Envoy's listener, which takes HTTP/1.1 and HTTP/2
//! alike: for requests no HTTP/1.1 client sends, such as one with trailers.

use bytes::Bytes;
use std::time::Duration;

/// What came back: the status (0 when the stream was reset without one) and the body.
#[derive(Debug, Clone)]
pub struct H2Response {
    pub status: u16,
    pub body: Vec<u8>,
}

/// Runs `exchange` on a runtime of its own, giving up after 20 s.
fn within_20s<T>(exchange: impl std::future::Future<Output = T>) -> T {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    rt.block_on(async { tokio::time::timeout(Duration::from_secs(20), exchange).await.expect("an h2c answer within 20 s") })
}

/// Connects to `127.0.0.1:port` over h2c and sends the head of `method path` with `headers`
/// (`end`: no body follows).
async fn start(port: u16, method: &str, path: &str, headers: &[(&str, &str)], end: bool) -> (h2::client::ResponseFuture, h2::SendStream<Bytes>) {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    let (client, connection) = h2::client::handshake(tcp).await.expect("an h2c handshake");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let mut client = client.ready().await.expect("a ready h2 client");
    let mut request = http::Request::builder().method(method).uri(format!("http://127.0.0.1:{port}{path}"));
    for (n, v) in headers {
        request = request.header(*n, *v);
    }
    client.send_request(request.body(()).expect("a request"), end).expect("send the headers")
}

/// Reads an answer's body to its end.
async fn read_body(body: &mut h2::RecvStream) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(chunk) = body.data().await {
        let Ok(chunk) = chunk else { break };
        let _ = body.flow_control().release_capacity(chunk.len());
        out.extend_from_slice(&chunk);
    }
    out
}

/// `method path` to `127.0.0.1:port` over h2c with `headers`, then `body` (in one DATA frame when
/// not empty) and `trailers`, which end the stream. Gives up after 20 s.
pub fn send_with_trailers(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    trailers: &[(&str, &str)],
) -> H2Response {
    within_20s(async {
        let (answer, mut stream) = start(port, method, path, headers, false).await;
        if !body.is_empty() {
            stream.send_data(Bytes::copy_from_slice(body), false).expect("send the body");
        }
        let mut map = http::HeaderMap::new();
        for (n, v) in trailers {
            map.append(http::HeaderName::from_bytes(n.as_bytes()).expect("a trailer name"), v.parse().expect("a trailer value"));
        }
        stream.send_trailers(map).expect("send the trailers");
        let Ok(response) = answer.await else {
            return H2Response { status: 0, body: Vec::new() };
        };
        let status = response.status().as_u16();
        H2Response { status, body: read_body(&mut response.into_body()).await }
    })
}

/// What a streamed exchange gave: the status, the answer head's headers, the body, and the
/// trailers that ended it.
#[derive(Debug, Clone)]
pub struct H2Exchange {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub trailers: Vec<(String, String)>,
}

/// `POST path` to `127.0.0.1:port` over h2c with `headers` and `body` (one DATA frame that ends
/// the request), read to the end of the answer and its trailers (a gRPC call's status is there).
/// Gives up after 20 s.
pub fn post_to_end(port: u16, path: &str, headers: &[(&str, &str)], body: &[u8]) -> H2Exchange {
    within_20s(async {
        let (answer, mut stream) = start(port, "POST", path, headers, body.is_empty()).await;
        if !body.is_empty() {
            stream.send_data(Bytes::copy_from_slice(body), true).expect("send the body");
        }
        let response = answer.await.expect("an answer");
        let status = response.status().as_u16();
        let pairs = |map: &http::HeaderMap| map.iter().map(|(n, v)| (n.to_string(), String::from_utf8_lossy(v.as_bytes()).into_owned())).collect();
        let headers = pairs(response.headers());
        let mut body = response.into_body();
        let out = read_body(&mut body).await;
        let trailers = body.trailers().await.ok().flatten().map(|t| pairs(&t)).unwrap_or_default();
        H2Exchange { status, headers, body: out, trailers }
    })
}
