//! The one rule for a setting out of range: every builder refuses it with
//! [`Error::InvalidSetting`] from its `build()` (never raised or lowered
//! in silence, never accepted to fail later), naming the setting, the value
//! and what is allowed.

use std::time::Duration;

use crate::Error;

/// Refuses `value` below `min`, naming `setting`.
pub(crate) fn at_least(setting: &'static str, value: Duration, min: Duration) -> Result<(), Error> {
    if value >= min {
        return Ok(());
    }
    Err(Error::InvalidSetting {
        setting,
        value: format!("{value:?}"),
        allowed: format!("at least {min:?}"),
    })
}

/// Refuses `value` outside `min..=max`, naming `setting`.
pub(crate) fn within(
    setting: &'static str,
    value: Duration,
    min: Duration,
    max: Duration,
) -> Result<(), Error> {
    if (min..=max).contains(&value) {
        return Ok(());
    }
    Err(Error::InvalidSetting {
        setting,
        value: format!("{value:?}"),
        allowed: format!("between {min:?} and {max:?}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_inclusive_and_the_refusal_names_the_setting() {
        let ms = Duration::from_millis;
        assert!(at_least("x", ms(10), ms(10)).is_ok());
        assert!(within("x", ms(10), ms(10), ms(20)).is_ok());
        assert!(within("x", ms(20), ms(10), ms(20)).is_ok());
        for refused in [
            at_least("x", ms(9), ms(10)),
            within("x", ms(9), ms(10), ms(20)),
            within("x", ms(21), ms(10), ms(20)),
        ] {
            assert!(
                matches!(&refused, Err(Error::InvalidSetting { setting: "x", .. })),
                "{refused:?}"
            );
        }
    }
}
