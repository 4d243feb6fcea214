//! Holding back the end of a response to an idempotency claim until its outcome is stored, so a
//! retry sent the moment the client has the answer finds the outcome, never the claim (a 409).
//!
//! Envoy holds a filter's data only from the frame the filter pauses on. A client reading a
//! `content-length` body is done at its last byte — it does not wait for the stream's end — and
//! Envoy's HTTP/1 codec delivers that byte in one frame and the end of the stream in a later,
//! empty one. Pausing the end alone let the answer out before the outcome was stored. So the frame
//! carrying the body's last byte is held (with no body: the headers). A response without a
//! declared length (chunked, HTTP/2 without one) ends for the client only with the stream, whose
//! end is held anyway. At most the last chunk is buffered: the response still streams.

/// Where a response to an idempotency claim stands.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum EndHold {
    /// Nothing to hold before the end of the stream (not a claim, or no declared length).
    #[default]
    AtEnd,
    /// This many body bytes are still to come; the chunk that brings the last one is held.
    Counting(u64),
    /// Everything from here is held until the outcome is stored.
    Holding,
}

impl EndHold {
    /// The response headers of an idempotency claim (not the end of the stream), with the
    /// upstream's `content-length`. An unparseable length is treated as none.
    pub fn from_length(content_length: Option<&str>) -> EndHold {
        match content_length.and_then(|v| v.trim().parse::<u64>().ok()) {
            Some(0) => EndHold::Holding,
            Some(n) => EndHold::Counting(n),
            None => EndHold::AtEnd,
        }
    }

    /// A body chunk of `size` bytes that does not end the stream: whether to hold it.
    pub fn hold_chunk(&mut self, size: usize) -> bool {
        match *self {
            EndHold::AtEnd => false,
            EndHold::Holding => true,
            EndHold::Counting(left) if size as u64 >= left => {
                *self = EndHold::Holding;
                true
            }
            EndHold::Counting(left) => {
                *self = EndHold::Counting(left - size as u64);
                false
            }
        }
    }

    /// Whether the headers are held (the response has no body to wait for).
    pub fn holds_headers(&self) -> bool {
        *self == EndHold::Holding
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chunk_with_the_last_byte_is_held_and_everything_after_it() {
        let mut h = EndHold::from_length(Some("10"));
        assert!(!h.holds_headers());
        assert!(!h.hold_chunk(4), "6 bytes still to come");
        assert!(!h.hold_chunk(5), "1 byte still to come");
        assert!(h.hold_chunk(1), "the last byte");
        assert!(h.hold_chunk(0), "and anything after it");
        // one chunk with the whole body (and more than declared: Envoy resets such a stream)
        assert!(EndHold::from_length(Some(" 3 ")).hold_chunk(3));
        assert!(EndHold::from_length(Some("3")).hold_chunk(4));
    }

    #[test]
    fn no_body_holds_the_headers_and_no_length_holds_only_the_end() {
        assert!(EndHold::from_length(Some("0")).holds_headers());
        for length in [None, Some("x"), Some("-1"), Some("")] {
            let mut h = EndHold::from_length(length);
            assert_eq!(h, EndHold::AtEnd, "{length:?}");
            assert!(!h.holds_headers() && !h.hold_chunk(1 << 20), "{length:?}: streams through");
        }
    }
}
