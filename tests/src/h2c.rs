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
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    let exchange = async {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.expect("connect to Envoy");
        let (client, connection) = h2::client::handshake(tcp).await.expect("an h2c handshake");
        tokio::spawn(async move {
            let _ = connection.await;
        });
        let mut client = client.ready().await.expect("a ready h2 client");
        let mut request = http::Request::builder().method(method).uri(format!("http://127.0.0.1:{port}{path}"));
        for (n, v) in headers {
            request = request.header(*n, *v);
        }
        let (answer, mut stream) = client.send_request(request.body(()).expect("a request"), false).expect("send the headers");
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
        let mut body = response.into_body();
        let mut out = Vec::new();
        while let Some(chunk) = body.data().await {
            let Ok(chunk) = chunk else { break };
            let _ = body.flow_control().release_capacity(chunk.len());
            out.extend_from_slice(&chunk);
        }
        H2Response { status, body: out }
    };
    rt.block_on(async { tokio::time::timeout(Duration::from_secs(20), exchange).await.expect("an h2c answer within 20 s") })
}

/// What a streamed exchange gave: the status, the body, and the trailers that ended it.
#[derive(Debug, Clone)]
pub struct H2Exchange {
    pub status: u16,
    pub body: Vec<u8>,
    pub trailers: Vec<(String, String)>,
}

/// `POST path` to `127.0.0.1:port` over h2c with `headers` and `body` (one DATA frame that ends
/// the request), read to the end of the answer and its trailers (a gRPC call's status is there).
/// Gives up after 20 s.
pub fn post_to_end(port: u16, path: &str, headers: &[(&str, &str)], body: &[u8]) -> H2Exchange {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    let exchange = async {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
        let (client, connection) = h2::client::handshake(tcp).await.expect("an h2c handshake");
        tokio::spawn(async move {
            let _ = connection.await;
        });
        let mut client = client.ready().await.expect("a ready h2 client");
        let mut request = http::Request::builder().method("POST").uri(format!("http://127.0.0.1:{port}{path}"));
        for (n, v) in headers {
            request = request.header(*n, *v);
        }
        let (answer, mut stream) = client.send_request(request.body(()).expect("a request"), body.is_empty()).expect("send the headers");
        if !body.is_empty() {
            stream.send_data(Bytes::copy_from_slice(body), true).expect("send the body");
        }
        let response = answer.await.expect("an answer");
        let status = response.status().as_u16();
        let mut body = response.into_body();
        let mut out = Vec::new();
        while let Some(chunk) = body.data().await {
            let Ok(chunk) = chunk else { break };
            let _ = body.flow_control().release_capacity(chunk.len());
            out.extend_from_slice(&chunk);
        }
        let trailers = body.trailers().await.ok().flatten().unwrap_or_default();
        let trailers = trailers.iter().map(|(n, v)| (n.to_string(), String::from_utf8_lossy(v.as_bytes()).into_owned())).collect();
        H2Exchange { status, body: out, trailers }
    };
    rt.block_on(async { tokio::time::timeout(Duration::from_secs(20), exchange).await.expect("an h2c answer within 20 s") })
}
