//! The API's controls on the logits before sampling: `logit_bias`, `presence_penalty`,
//! `frequency_penalty`, and `repetition_penalty` (an extension, as vLLM and llama.cpp offer it).
//! Per sequence, on its own history, so a request's text still does not depend on the batch.
//!
//! For token `i` with logit `l`, seen `c` times among the tokens generated so far:
//!
//! ```text
//! l1 = l / r if l > 0, l · r otherwise      when i is in the prompt or was generated (r = repetition_penalty)
//! l2 = l1 − frequency · c − presence · [c > 0]
//! l3 = l2 + logit_bias[i]
//! ```
//!
//! then temperature, top-k and top-p as usual. Presence and frequency count generated tokens
//! only (as vLLM and the API's description do); repetition looks at the prompt too (as
//! Hugging Face's `repetition_penalty` does).

use std::collections::{HashMap, HashSet};

/// The settings of one request; `None` when it sets none of them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Penalties {
    pub presence: f32,
    pub frequency: f32,
    pub repetition: f32,
    pub bias: Vec<(u32, f32)>,
}

impl Penalties {
    /// Whether the settings change nothing.
    pub fn neutral(&self) -> bool {
        self.presence == 0.0
            && self.frequency == 0.0
            && self.repetition == 1.0
            && self.bias.is_empty()
    }
}

/// A sequence's history as the penalties need it.
pub struct History {
    counts: HashMap<u32, u32>,
    /// Tokens of the prompt or generated (for the repetition penalty).
    seen: HashSet<u32>,
}

impl History {
    pub fn new(prompt: &[u32]) -> History {
        History { counts: HashMap::new(), seen: prompt.iter().copied().collect() }
    }

    pub fn push(&mut self, token: u32) {
        *self.counts.entry(token).or_default() += 1;
        self.seen.insert(token);
    }

    /// `logits` adjusted as the module's documentation says.
    pub fn apply(&self, p: &Penalties, logits: &mut [f32]) {
        if p.repetition != 1.0 {
            for &i in &self.seen {
                let l = &mut logits[i as usize];
                *l = if *l > 0.0 { *l / p.repetition } else { *l * p.repetition };
            }
        }
        for (&i, &c) in &self.counts {
            logits[i as usize] -= p.frequency * c as f32 + p.presence;
        }
        for &(i, b) in &p.bias {
            logits[i as usize] += b;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the formulas worked by hand on five logits.
    #[test]
    fn penalties_follow_their_definitions() {
        let p = Penalties {
            presence: 0.5,
            frequency: 0.25,
            repetition: 2.0,
            bias: vec![(4, -3.0), (0, 1.0)],
        };
        let mut h = History::new(&[1]);
        for t in [2, 2, 3] {
            h.push(t);
        }
        let mut l = [1.0f32, 2.0, -1.0, 4.0, 0.5];
        h.apply(&p, &mut l);
        // 0: bias +1; 1: prompt only, 2 / 2; 2: seen twice, -1 · 2 − 0.25 · 2 − 0.5;
        // 3: once, 4 / 2 − 0.25 − 0.5; 4: bias −3.
        assert_eq!(l, [2.0, 1.0, -3.0, 1.25, -2.5]);
        assert!(Penalties { repetition: 1.0, ..Default::default() }.neutral());
        assert!(!p.neutral());
    }
}
