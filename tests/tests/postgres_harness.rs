//! The PostgreSQL guard itself: starts, accepts connections, survives a stop/start.

use tollgate_tests::postgres::Postgres;

fn accepts(port: u16) -> bool {
    std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
}

#[test]
fn postgres_starts_stops_and_starts_again() {
    let mut pg = Postgres::start();
    assert!(accepts(pg.port));
    assert!(pg.url().starts_with("postgres://postgres@127.0.0.1:"));
    pg.stop();
    assert!(!accepts(pg.port));
    pg.start_again();
    assert!(accepts(pg.port));
}
