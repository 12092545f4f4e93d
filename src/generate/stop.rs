//! Stop strings over incrementally decoded text.

/// Finds the first occurrence of any stop string in growing text, searching
/// only the region that new text can complete, and tells how much text is
/// safe to emit to a stream (never a prefix of a stop string that may still
/// complete).
#[derive(Debug, Clone, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    max_len: usize,
    searched: usize,
}

impl StopStrings {
    pub fn new(stops: &[String]) -> StopStrings {
        let stops: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        let max_len = stops.iter().map(|s| s.len()).max().unwrap_or(0);
        StopStrings { stops, max_len, searched: 0 }
    }

    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Byte offset where a stop string begins in `text`, if one has appeared.
    pub fn find(&mut self, text: &str) -> Option<usize> {
        if self.stops.is_empty() {
            return None;
        }
        let mut from = self.searched.saturating_sub(self.max_len.saturating_sub(1));
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        let hit = self.stops.iter().filter_map(|s| text[from..].find(s.as_str()).map(|i| i + from)).min();
        self.searched = text.len();
        hit
    }

    /// How many bytes of `text` can be streamed now: all but a tail that is a
    /// proper prefix of some stop string.
    pub fn safe_len(&self, text: &str) -> usize {
        let mut hold = 0;
        for s in &self.stops {
            for l in (1..s.len().min(text.len() + 1)).rev() {
                if s.is_char_boundary(l) && text.ends_with(&s[..l]) {
                    hold = hold.max(l);
                    break;
                }
            }
        }
        text.len() - hold
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_across_pushes_and_holds_prefixes() {
        let mut s = StopStrings::new(&["\n\nUser:".to_string(), "END".to_string()]);
        assert_eq!(s.find("hello\n"), None);
        assert_eq!(s.safe_len("hello\n"), 5);
        assert_eq!(s.find("hello\n\nUs"), None);
        assert_eq!(s.find("hello\n\nUser: hi"), Some(5));
        let mut s = StopStrings::new(&["END".to_string()]);
        assert_eq!(s.find("aE"), None);
        assert_eq!(s.safe_len("aEN"), 1);
        assert_eq!(s.find("aENDb"), Some(1));
        assert_eq!(StopStrings::new(&[]).safe_len("abc"), 3);
    }

    #[test]
    fn multibyte_boundaries() {
        let mut s = StopStrings::new(&["é!".to_string()]);
        assert_eq!(s.find("caf"), None);
        assert_eq!(s.safe_len("café"), 3);
        assert_eq!(s.find("café!"), Some(3));
    }
}
