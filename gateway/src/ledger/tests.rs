//! Tests of the state machine.

use super::*;

#[test]
fn completed_never_goes_back() {
    for to in State::ALL {
        let ok = State::Completed.can_transition_to(to);
        // COMPLETED → COMPLETED records an audited forced replay; the state never goes back.
        assert_eq!(
            ok,
            matches!(to, State::Compensated | State::Completed),
            "COMPLETED → {to}"
        );
    }
}

#[test]
fn state_names_round_trip() {
    for s in State::ALL {
        assert_eq!(s.as_str().parse::<State>().unwrap(), s);
    }
    assert!("nope".parse::<State>().is_err());
}
