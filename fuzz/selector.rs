//! Fuzz target: label and field selectors of the simulated API server
//! (`crates/devcluster/src/selector.rs`), as they arrive in `labelSelector` and
//! `fieldSelector` query parameters.
//!
//! Properties: a selector that parses prints (in canonical query syntax)
//! to text that parses to the same selector, and prints the same again;
//! and a selector of equalities and existence checks matches the labels it
//! names. Run with `make fuzz`.

#![no_main]
// A fuzz target: a failed unwrap is a finding.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use skipper_devcluster::selector::{FieldSelector, LabelSelector, Requirement};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(sel) = LabelSelector::parse(text) {
        let printed = sel.to_string();
        let again = LabelSelector::parse(&printed)
            .unwrap_or_else(|e| panic!("{text:?} printed as {printed:?}, which does not parse: {e}"));
        assert_eq!(again, sel, "{text:?} printed as {printed:?}");
        assert_eq!(again.to_string(), printed);
        // A selector of equalities and existence checks matches the labels
        // those requirements name (when they do not contradict each other).
        if sel
            .0
            .iter()
            .all(|r| matches!(r, Requirement::Eq(..) | Requirement::Exists(_)))
        {
            let mut labels = BTreeMap::new();
            let mut consistent = true;
            for r in &sel.0 {
                if let Requirement::Eq(k, v) = r
                    && labels.insert(k.clone(), v.clone()).is_some_and(|old| old != *v)
                {
                    consistent = false;
                }
            }
            for r in &sel.0 {
                if let Requirement::Exists(k) = r {
                    labels.entry(k.clone()).or_default();
                }
            }
            if consistent {
                assert!(sel.matches(&labels), "{sel:?} does not match {labels:?}");
            }
        }
    }
    if let Ok(sel) = FieldSelector::parse(text) {
        let printed = sel.to_string();
        let again = FieldSelector::parse(&printed)
            .unwrap_or_else(|e| panic!("{text:?} printed as {printed:?}, which does not parse: {e}"));
        assert_eq!(again, sel, "{text:?} printed as {printed:?}");
    }
});
