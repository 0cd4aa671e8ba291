//! The poll board: one entry per backend in the region, where the process that polls a
//! backend's engine publishes what it read, for the other processes attached to the region
//! (the workers of `--workers N`) to follow instead of polling the engine themselves.
//!
//! The payload is opaque bytes (the gateway writes a small JSON record), at most
//! [`BOARD_PAYLOAD_BYTES`]. Each entry is a sequence lock whose word also holds the time its
//! last write began: a writer makes the word odd with a compare-and-swap (a second writer that
//! finds it odd gives up: publishing is best effort, the next poll publishes again), stores the
//! payload, its length and a checksum of them with the even word it will end with, then makes
//! the word even. A reader keeps its copy only if the word was even and unchanged around it and
//! the checksum matches. A writer killed in the middle leaves the word odd: the next writer
//! takes the entry over once the word's time is [`STUCK_MS`] old. A writer that was only
//! stopped and resumes after such a takeover may still store its payload, but its final
//! compare-and-swap fails and its checksum, made for a word the entry never shows, marks what
//! it stored as torn: readers skip it until the next write.

use std::sync::atomic::{fence, AtomicU64, Ordering};

use super::config::config_err;
use super::region::{BoardEntry, BOARD_WORDS};
use super::Admission;
use crate::clock::monotonic_ns;
use crate::error::CoreError;

/// Largest payload a board entry holds, in bytes.
pub const BOARD_PAYLOAD_BYTES: usize = BOARD_WORDS * 8;

/// How long an entry stays odd before another writer takes it over (milliseconds): a write
/// takes microseconds, so an entry odd this long belongs to a writer that died in it.
const STUCK_MS: u64 = 1_000;

/// Bits of the sequence word that count writes; the rest is the time (ms).
const COUNTER_BITS: u32 = 24;
const COUNTER_MASK: u64 = (1 << COUNTER_BITS) - 1;

/// The word a write that begins at `now_ms` after the word `prev` holds while it runs (odd).
fn begin_word(prev: u64, now_ms: u64) -> u64 {
    let counter = ((prev & COUNTER_MASK) | 1).wrapping_add(2) & COUNTER_MASK;
    (now_ms << COUNTER_BITS) | counter
}

/// FNV-1a (64 bits) over the sequence word, the length and the payload's words.
fn checksum(word: u64, len: u64, data: &[u64]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in [word, len].iter().chain(data) {
        for b in w.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

fn store_words(dst: &[AtomicU64], payload: &[u8]) -> [u64; BOARD_WORDS] {
    let mut buf = [0u8; BOARD_PAYLOAD_BYTES];
    buf[..payload.len()].copy_from_slice(payload);
    let mut words = [0u64; BOARD_WORDS];
    for ((w, chunk), out) in dst.iter().zip(buf.chunks_exact(8)).zip(words.iter_mut()) {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        *out = u64::from_le_bytes(word);
        w.store(*out, Ordering::Relaxed);
    }
    words
}

impl Admission {
    /// Publishes `payload` on backend `id`'s board entry. Returns the entry's new sequence
    /// word (even, > 0, unlike the words before it: the time the write began, in ms, and a
    /// counter), or `None` when another process was
    /// writing the entry at that moment or took it over meanwhile (the payload is dropped:
    /// the caller publishes again at its next poll).
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
        let now_ms = monotonic_ns() / 1_000_000;
        let mut seq = e.seq.load(Ordering::Acquire);
        let mine = loop {
            if seq % 2 == 1 && now_ms.saturating_sub(seq >> COUNTER_BITS) < STUCK_MS {
                return Ok(None); // a live writer's
            }
            // even: take it; odd for long: take it over (a writer that resumes finds another
            // word and gives up)
            let mine = begin_word(seq, now_ms.max(seq >> COUNTER_BITS));
            match e
                .seq
                .compare_exchange(seq, mine, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break mine,
                Err(current) => seq = current,
            }
        };
        fence(Ordering::Release);
        let words = store_words(&e.data, payload);
        let len = payload.len() as u64;
        let done = mine + 1;
        e.len.store(len, Ordering::Relaxed);
        e.sum.store(checksum(done, len, &words), Ordering::Relaxed);
        if e.seq
            .compare_exchange(mine, done, Ordering::Release, Ordering::Relaxed)
            .is_err()
        {
            return Ok(None); // taken over while this process stood still: its write is void
        }
        Ok(Some(done))
    }

    /// The payload last published on backend `id`'s board entry with its sequence word, or
    /// `None` when nothing was published yet, or a write was in progress on every try (read
    /// again later), or what the entry holds is torn (a writer that resumed after its entry
    /// was taken over). A torn payload is never returned.
    ///
    /// Errors: an unknown backend id.
    pub fn read_board(&self, id: u32) -> Result<Option<(u64, Vec<u8>)>, CoreError> {
        self.backend(id)?;
        let e: &BoardEntry = self.board_at(id as usize);
        for _ in 0..64 {
            let before = e.seq.load(Ordering::Acquire);
            if before == 0 {
                return Ok(None);
            }
            if before % 2 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let len = e.len.load(Ordering::Relaxed);
            let sum = e.sum.load(Ordering::Relaxed);
            let mut words = [0u64; BOARD_WORDS];
            for (w, out) in e.data.iter().zip(words.iter_mut()) {
                *out = w.load(Ordering::Relaxed);
            }
            fence(Ordering::Acquire);
            if e.seq.load(Ordering::Relaxed) != before {
                continue;
            }
            if sum != checksum(before, len, &words) || len > BOARD_PAYLOAD_BYTES as u64 {
                return Ok(None); // torn: no write can be waited for
            }
            let mut buf = Vec::with_capacity(BOARD_PAYLOAD_BYTES);
            for w in words {
                buf.extend_from_slice(&w.to_le_bytes());
            }
            buf.truncate(len as usize);
            return Ok(Some((before, buf)));
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

    fn now_ms() -> u64 {
        monotonic_ns() / 1_000_000
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
        assert!(short > second);
        assert_eq!(a.read_board(0).unwrap(), Some((short, Vec::new())));
    }

    #[test]
    fn the_counter_wraps_without_breaking_the_order_or_the_parity() {
        let w = begin_word(COUNTER_MASK - 1, 7); // the last even count
        assert_eq!(w % 2, 1);
        assert_eq!(w >> COUNTER_BITS, 7);
        let odd = begin_word(COUNTER_MASK, 8); // from an odd word (a takeover)
        assert_eq!(odd % 2, 1);
        assert!(odd > w);
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
        let old = a.publish_board(0, b"old").unwrap().unwrap();
        let e = a.board_at(0);
        // a writer that made the entry odd just now and stopped there
        let live = begin_word(old, now_ms());
        e.seq.store(live, Ordering::Release);
        assert_eq!(
            a.read_board(0).unwrap(),
            None,
            "a write in progress is never read"
        );
        assert_eq!(
            a.publish_board(0, b"new").unwrap(),
            None,
            "a live writer is not overrun"
        );
        // the same writer, odd for longer than STUCK_MS: dead, taken over
        let dead = begin_word(old, now_ms().saturating_sub(STUCK_MS + 1));
        e.seq.store(dead, Ordering::Release);
        let seq = a.publish_board(0, b"new").unwrap().unwrap();
        assert!(seq > dead);
        assert_eq!(a.read_board(0).unwrap(), Some((seq, b"new".to_vec())));
    }

    #[test]
    fn a_writer_that_resumes_after_a_takeover_leaves_nothing_readable() {
        let a = region();
        let e = a.board_at(0);
        let old = a.publish_board(0, b"old").unwrap().unwrap();
        // writer A made the entry odd long ago and stopped; B takes it over and publishes
        let a_word = begin_word(old, now_ms().saturating_sub(STUCK_MS + 1));
        e.seq.store(a_word, Ordering::Release);
        let b_word = a.publish_board(0, b"B's record").unwrap().unwrap();
        // A resumes: stores its payload, length and checksum, and its final swap fails
        let words = store_words(&e.data, b"A's late record, longer");
        e.len.store(23, Ordering::Relaxed);
        e.sum
            .store(checksum(a_word + 1, 23, &words), Ordering::Relaxed);
        assert!(e
            .seq
            .compare_exchange(a_word, a_word + 1, Ordering::Release, Ordering::Relaxed)
            .is_err());
        assert_eq!(e.seq.load(Ordering::Acquire), b_word);
        assert_eq!(a.read_board(0).unwrap(), None, "torn: never read");
        let c_word = a.publish_board(0, b"next").unwrap().unwrap();
        assert_eq!(a.read_board(0).unwrap(), Some((c_word, b"next".to_vec())));
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
                    let mut last = 0u64;
                    while !stop.load(Ordering::Acquire) {
                        if let Some((seq, p)) = a.read_board(0).unwrap() {
                            // every payload is one byte repeated, its length that byte
                            let b = p[0];
                            assert_eq!(p.len(), usize::from(b), "length and payload agree");
                            assert!(p.iter().all(|&x| x == b), "no torn payload");
                            assert!(seq >= last, "the sequence word only grows");
                            last = seq;
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
