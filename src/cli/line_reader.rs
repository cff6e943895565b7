//! `kvrecv serve`'s stdin, one line at a time, with a cap: a line that is not UTF-8 or is longer
//! than the cap is reported as such (the caller answers it with an `error` line and goes on)
//! instead of ending the input, and an over-long line is skipped without being kept in memory.

#![forbid(unsafe_code)]

use tokio::io::{AsyncBufRead, AsyncBufReadExt};

/// One input line, without its `\n` (or `\r\n`).
#[derive(Debug, PartialEq, Eq)]
pub enum Line {
    Text(String),
    /// Not UTF-8: the first invalid byte is at `valid_up_to`.
    NotUtf8 {
        valid_up_to: usize,
    },
    /// Longer than the cap: `len` bytes were read and dropped.
    TooLong {
        len: usize,
    },
}

/// A capped line reader.
pub struct LineReader<R> {
    inner: R,
    max: usize,
    buf: Vec<u8>,
    /// Bytes of the current line seen so far (kept or not).
    len: usize,
    overflow: bool,
}

impl<R: AsyncBufRead + Unpin> LineReader<R> {
    /// Lines longer than `max` bytes are reported as [`Line::TooLong`].
    pub fn new(inner: R, max: usize) -> Self {
        LineReader {
            inner,
            max,
            buf: Vec::new(),
            len: 0,
            overflow: false,
        }
    }

    /// The next line; `None` at end of input. Cancel-safe (it runs inside `select!`): bytes are
    /// taken from `inner` only together with recording them here, with no await in between.
    pub async fn next_line(&mut self) -> std::io::Result<Option<Line>> {
        loop {
            let avail = self.inner.fill_buf().await?;
            if avail.is_empty() {
                // End of input: a last line without `\n` still counts.
                return Ok((self.len > 0).then(|| self.finish()));
            }
            // A SIMD search: a byte-at-a-time loop over a batch's 2.5 KB line was 1.5% of
            // serve's actors' thread.
            let (chunk, used, done) = match memchr::memchr(b'\n', avail) {
                Some(i) => (&avail[..i], i + 1, true),
                None => (avail, avail.len(), false),
            };
            self.len += chunk.len();
            if !self.overflow {
                if self.buf.len() + chunk.len() > self.max {
                    self.overflow = true;
                    self.buf = Vec::new(); // give the memory back now
                } else {
                    self.buf.extend_from_slice(chunk);
                }
            }
            self.inner.consume(used);
            if done {
                return Ok(Some(self.finish()));
            }
        }
    }

    fn finish(&mut self) -> Line {
        let len = std::mem::take(&mut self.len);
        let mut bytes = std::mem::take(&mut self.buf);
        if std::mem::take(&mut self.overflow) {
            return Line::TooLong { len };
        }
        if bytes.last() == Some(&b'\r') {
            bytes.pop();
        }
        match String::from_utf8(bytes) {
            Ok(s) => Line::Text(s),
            Err(e) => Line::NotUtf8 {
                valid_up_to: e.utf8_error().valid_up_to(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use futures::FutureExt;
    use tokio::io::{AsyncWriteExt, BufReader};

    use super::*;

    async fn all(input: &[u8], max: usize, chunk: usize) -> Vec<Line> {
        // a small BufReader capacity makes lines span several fill_buf calls
        let mut r = LineReader::new(BufReader::with_capacity(chunk, input), max);
        let mut v = vec![];
        while let Some(l) = r.next_line().await.unwrap() {
            v.push(l);
        }
        v
    }

    #[tokio::test]
    async fn bad_lines_are_reported_and_reading_goes_on() {
        let mut input = b"{\"op\":\"drain\"}\r\n\xff\xfeoops\n".to_vec();
        input.extend(std::iter::repeat_n(b'x', 100));
        input.extend(b"\nlast");
        for chunk in [1, 3, 4096] {
            assert_eq!(
                all(&input, 16, chunk).await,
                vec![
                    Line::Text("{\"op\":\"drain\"}".into()),
                    Line::NotUtf8 { valid_up_to: 0 },
                    Line::TooLong { len: 100 },
                    Line::Text("last".into()),
                ],
                "chunk {chunk}"
            );
        }
        assert_eq!(all(b"", 16, 8).await, vec![]);
        assert_eq!(all(b"\n", 16, 8).await, vec![Line::Text(String::new())]);
        assert_eq!(
            all(&[b'a'; 16], 16, 8).await,
            vec![Line::Text("a".repeat(16))],
            "exactly at the cap is fine"
        );
    }

    #[tokio::test]
    async fn a_cancelled_read_loses_nothing() {
        let (mut tx, rx) = tokio::io::duplex(64);
        let mut r = LineReader::new(BufReader::new(rx), 1024);
        tx.write_all(b"hel").await.unwrap();
        // one poll takes "hel" and then waits for the rest; dropping it cancels, as select! does
        assert!(r.next_line().now_or_never().is_none());
        tx.write_all(b"lo\n").await.unwrap();
        assert_eq!(
            r.next_line().await.unwrap(),
            Some(Line::Text("hello".into()))
        );
    }
}
