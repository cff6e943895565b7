//! Text a peer chose (P's `err_msg`, the ids a reply names that D never sent, a decoder's
//! complaint quoting a reply) on its way into events, drain answers and logs: bounded, with
//! control characters escaped. P's message is repeated for every request it fails, in the
//! settle, the first failure, the completion and a log line each, so one 4 MB reply failing 64
//! requests once became a gigabyte of output; and a raw newline or escape sequence in it forged
//! lines in serve's log and drove the operator's terminal.

#![forbid(unsafe_code)]

use std::borrow::Cow;

/// The most bytes of a peer's text kept (P's own messages are one short line).
pub const MAX_PEER_TEXT: usize = 256;

/// `s` as it may be printed: at most [`MAX_PEER_TEXT`] bytes of it (cut at a character, the cut
/// said with the original length), control characters escaped (`\n`, `\u{1b}`). Borrowed when
/// `s` is short and clean, as P's messages are.
///
/// ```
/// use kvrecv::messages::peer_text::peer_text;
/// assert_eq!(peer_text("TE failed"), "TE failed");
/// assert_eq!(peer_text("a\nb\x1b[31m"), "a\\nb\\u{1b}[31m");
/// assert!(peer_text(&"E".repeat(1 << 20)).ends_with("(1048576 bytes from the peer)"));
/// ```
pub fn peer_text(s: &str) -> Cow<'_, str> {
    if s.len() <= MAX_PEER_TEXT && !s.chars().any(char::is_control) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(MAX_PEER_TEXT + 48);
    let mut cut = false;
    for c in s.chars() {
        let before = out.len();
        if c.is_control() {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
        if out.len() > MAX_PEER_TEXT {
            out.truncate(before);
            cut = true;
            break;
        }
    }
    if cut {
        out.push_str(&format!("… ({} bytes from the peer)", s.len()));
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_clean_text_is_kept_as_it_is() {
        let s = "Mooncake transfer engine returned -1";
        assert!(matches!(peer_text(s), Cow::Borrowed(b) if b == s));
        let exact = "é".repeat(MAX_PEER_TEXT / 2);
        assert_eq!(peer_text(&exact), exact, "exactly at the bound");
    }

    #[test]
    fn long_text_is_cut_at_a_character_and_says_so() {
        // Two-byte characters across the bound: the cut falls between two of them.
        let s = format!("a{}", "é".repeat(4000));
        let t = peer_text(&s);
        let kept = t.split('…').next().unwrap();
        assert!(
            kept.len() <= MAX_PEER_TEXT && kept.len() >= MAX_PEER_TEXT - 1,
            "{}",
            kept.len()
        );
        assert!(s.starts_with(kept));
        assert!(
            t.ends_with(&format!("({} bytes from the peer)", s.len())),
            "{t}"
        );
    }

    #[test]
    fn control_characters_are_escaped_so_no_log_line_can_be_forged() {
        let t = peer_text("line1\nline2\r\0\x1b[31mred\u{85}");
        assert!(!t.chars().any(char::is_control), "{t:?}");
        assert_eq!(t, "line1\\nline2\\r\\0\\u{1b}[31mred\\u{85}");
        // Escapes count towards the bound too.
        let newlines = "\n".repeat(10_000);
        let t = peer_text(&newlines);
        assert!(t.len() < MAX_PEER_TEXT + 48, "{}", t.len());
    }
}
