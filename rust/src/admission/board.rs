//! The poll board: one entry per backend in the region, where the process that polls a
//! backend's engine publishes what it read, for the other processes attached to the region
//! (the workers of `--workers N`) to follow instead of polling the engine themselves.
//!
//! The payload is opaque bytes (the gateway writes a small JSON record), at most
//! [`BOARD_PAYLOAD_BYTES`]. Each entry is a sequence lock: a writer makes the sequence odd with
//! a compare-and-swap (a second writer that finds it odd gives up: publishing is best effort,
//! the next poll publishes again), stores the payload, then makes the sequence even again; a
//! reader keeps its copy of the payload only if the sequence was even and unchanged around it.
//! A writer killed in the middle leaves the sequence odd: the next writer takes the entry over
//! once it has been odd for [`STUCK_NS`].

use std::sync::atomic::{fence, Ordering};

use super::config::config_err;
use super::region::BOARD_WORDS;
use super::Admission;
use crate::clock::monotonic_ns;
use crate::error::CoreError;

/// Largest payload a board entry holds, in bytes.
pub const BOARD_PAYLOAD_BYTES: usize = BOARD_WORDS * 8;

/// How long an entry stays odd before another writer takes it over (nanoseconds): a write
/// takes microseconds, so an entry odd this long belongs to a writer that died in it.
const STUCK_NS: u64 = 1_000_000_000;

impl Admission {
    /// Publishes `payload` on backend `id`'s board entry. Returns the entry's new sequence
    /// number (even, > 0), or `None` when another process was writing it at that moment (the
    /// payload is dropped: the caller publishes again at its next poll).
    ///
    /// Errors: an unknown backend id, or a payload longer than [`BOARD_PAYLOAD_BYTES`].
    pub fn publish_board(&self, id: u32, payload: &[u8]) -> Result<Option<u64>, CoreError> {
        self.backend(id)?;
        if payload.len() > BOARD_PAYLOAD_BYTES {
            return config_err(format!(
                "a board payload holds at most {BOARD_PAYLOAD_BYTES} bytes (got {})",
                payload.len()
            ));
        }
        let e = self.board_at(id as usize);
        let now = monotonic_ns();
        let mut seq = e.seq.load(Ordering::Acquire);
        let mine = loop {
            let odd = seq % 2 == 1;
            if odd && now.saturating_sub(e.since.load(Ordering::Acquire)) < STUCK_NS {
                return Ok(None);
            }
            // even: take it (odd); odd for long: take it over (odd, and a writer that wakes
            // up finds another sequence and gives up)
            let mine = if odd { seq + 2 } else { seq + 1 };
            match e
                .seq
                .compare_exchange(seq, mine, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break mine,
                Err(current) => seq = current,
            }
        };
        e.since.store(now, Ordering::Release);
        fence(Ordering::Release);
        let mut buf = [0u8; BOARD_PAYLOAD_BYTES];
        buf[..payload.len()].copy_from_slice(payload);
        for (w, chunk) in e.data.iter().zip(buf.chunks_exact(8)) {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            w.store(u64::from_le_bytes(word), Ordering::Relaxed);
        }
        e.len.store(payload.len() as u64, Ordering::Relaxed);
        let done = mine + 1;
        if e.seq
            .compare_exchange(mine, done, Ordering::Release, Ordering::Relaxed)
            .is_err()
        {
            return Ok(None); // taken over while this process stood still: its write is void
        }
        Ok(Some(done))
    }

    /// The payload last published on backend `id`'s board entry with its sequence number, or
    /// `None` when nothing was published yet or a write was in progress on every try (read
    /// again later).
    ///
    /// Errors: an unknown backend id.
    pub fn read_board(&self, id: u32) -> Result<Option<(u64, Vec<u8>)>, CoreError> {
        self.backend(id)?;
        let e = self.board_at(id as usize);
        for _ in 0..64 {
            let before = e.seq.load(Ordering::Acquire);
            if before == 0 {
                return Ok(None);
            }
            if before % 2 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let len = usize::try_from(e.len.load(Ordering::Relaxed))
                .unwrap_or(usize::MAX)
                .min(BOARD_PAYLOAD_BYTES);
            let mut buf = Vec::with_capacity(BOARD_PAYLOAD_BYTES);
            for w in &e.data {
                buf.extend_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
            }
            fence(Ordering::Acquire);
            if e.seq.load(Ordering::Relaxed) == before {
                buf.truncate(len);
                return Ok(Some((before, buf)));
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::admission::{BackendConfig, Capacity};
    use crate::clock::Clock;

    fn region() -> Arc<Admission> {
        let a =
            Admission::new_heap_with(Clock::Monotonic, Capacity::for_counts(2, 1, 1, 1)).unwrap();
        let c = BackendConfig {
            max_concurrency: 4,
            tokens_per_minute: 6000,
            burst_tokens: None,
            inflight_token_limit: None,
        };
        a.add_backend("b0", &c).unwrap();
        a
    }

    #[test]
    fn nothing_published_reads_none() {
        let a = region();
        assert_eq!(a.read_board(0).unwrap(), None);
        assert!(
            a.read_board(1).is_err(),
            "an unregistered backend is refused"
        );
    }

    #[test]
    fn publish_then_read_round_trips() {
        let a = region();
        let first = a.publish_board(0, b"{\"a\":1}").unwrap().unwrap();
        assert_eq!(
            a.read_board(0).unwrap(),
            Some((first, b"{\"a\":1}".to_vec()))
        );
        let long = vec![b'x'; BOARD_PAYLOAD_BYTES];
        let second = a.publish_board(0, &long).unwrap().unwrap();
        assert!(second > first && second % 2 == 0);
        assert_eq!(a.read_board(0).unwrap(), Some((second, long)));
        let short = a.publish_board(0, b"").unwrap().unwrap();
        assert_eq!(a.read_board(0).unwrap(), Some((short, Vec::new())));
    }

    #[test]
    fn oversized_payload_is_refused() {
        let a = region();
        let err = a
            .publish_board(0, &vec![0; BOARD_PAYLOAD_BYTES + 1])
            .unwrap_err();
        assert!(err.to_string().contains("at most"), "{err}");
        assert_eq!(a.read_board(0).unwrap(), None);
    }

    #[test]
    fn a_write_in_progress_is_not_read_and_a_dead_writer_is_taken_over() {
        let a = region();
        a.publish_board(0, b"old").unwrap().unwrap();
        let e = a.board_at(0);
        // a writer that made the entry odd and stopped there, just now
        let odd = e.seq.fetch_add(1, Ordering::AcqRel) + 1;
        e.since.store(monotonic_ns(), Ordering::Release);
        assert_eq!(a.read_board(0).unwrap(), None, "a torn entry is never read");
        assert_eq!(
            a.publish_board(0, b"new").unwrap(),
            None,
            "a live writer is not overrun"
        );
        // the same writer, odd for longer than STUCK_NS: dead, taken over
        e.since.store(
            monotonic_ns().saturating_sub(STUCK_NS + 1),
            Ordering::Release,
        );
        let seq = a.publish_board(0, b"new").unwrap().unwrap();
        assert_eq!(seq, odd + 3);
        assert_eq!(a.read_board(0).unwrap(), Some((seq, b"new".to_vec())));
    }

    #[test]
    fn readers_on_threads_never_see_a_torn_payload() {
        let a = region();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let readers: Vec<_> = (0..3)
            .map(|_| {
                let (a, stop) = (Arc::clone(&a), Arc::clone(&stop));
                std::thread::spawn(move || {
                    let mut seen = 0u64;
                    while !stop.load(Ordering::Acquire) {
                        if let Some((_, p)) = a.read_board(0).unwrap() {
                            // every payload is one byte repeated, its length that byte
                            let b = p[0];
                            assert_eq!(p.len(), usize::from(b), "length and payload agree");
                            assert!(p.iter().all(|&x| x == b), "no torn payload");
                            seen += 1;
                        }
                    }
                    seen
                })
            })
            .collect();
        for i in 0..200_000u32 {
            let b = (i % 250 + 1) as u8;
            a.publish_board(0, &vec![b; usize::from(b)]).unwrap();
        }
        stop.store(true, Ordering::Release);
        let seen: u64 = readers.into_iter().map(|t| t.join().unwrap()).sum();
        assert!(seen > 0);
    }
}
