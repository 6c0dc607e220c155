//! The token sequence's settings, and which of them keep it from giving
//! rising tokens. A DBA may pre-create the sequence (docs/postgres.md invites it)
//! or `ALTER` it while services run, so the backend reads its settings from
//! the catalogs whenever a lock session opens and refuses a sequence that
//! could hand out a token at or below an earlier one, with the statement
//! that fixes it — including one far ahead of the clock, which the clock
//! floor could not stand in for if it were lost.

use super::connection::Failure;

/// Room a sequence's maximum must leave above the clock, as tokens are
/// floored by the clock in microseconds: a century (36,525 days).
const CENTURY_US: i64 = 36_525 * 86_400 * 1_000_000;

/// How far ahead of the clock in microseconds the sequence may be. Tokens
/// come from the sequence only while it is ahead of the clock, and the
/// backend keeps it at the clock (a burst of more than a token a
/// microsecond gets it ahead by that burst's excess, microseconds); a day
/// leaves room for a server clock set right by hours, and refuses a
/// sequence started or set far ahead.
const DAY_US: i64 = 86_400 * 1_000_000;

/// The settings of `<schema>.dlock_token_seq`, as `pg_sequence` has them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Settings {
    pub(super) increment: i64,
    pub(super) cache: i64,
    pub(super) cycle: bool,
    pub(super) max: i64,
    /// `bigint`, `integer` or `smallint`.
    pub(super) data_type: String,
    /// The server clock in microseconds, read with the settings.
    pub(super) clock_us: i64,
    /// The last value drawn (or set), if there is one.
    pub(super) last_value: Option<i64>,
    /// The value the first `nextval` returns when none was drawn yet
    /// (after a `RESTART WITH n` it is `n`, which only SELECT on the
    /// sequence could read: such a value is judged once drawn, when the
    /// next lock session opens).
    pub(super) start: i64,
}

impl Settings {
    /// Refuses settings that cannot give rising tokens: the message names
    /// each problem and the one `ALTER SEQUENCE` that fixes them all.
    pub(super) fn check(&self, quoted_schema: &str) -> Result<(), Failure> {
        let mut problems = Vec::new();
        let mut fix = Vec::new();
        let max_too_small = self.max < self.clock_us.saturating_add(CENTURY_US);
        if max_too_small && self.data_type != "bigint" {
            fix.push("AS bigint".to_owned());
        }
        if self.increment <= 0 {
            problems.push(format!(
                "INCREMENT BY {}: its numbers fall instead of rising",
                self.increment
            ));
            fix.push("INCREMENT BY 1".to_owned());
        }
        if max_too_small {
            let room = if self.max < self.clock_us {
                ""
            } else {
                " for less than a century"
            };
            problems.push(format!(
                "MAXVALUE {} (AS {}) cannot hold tokens, which are at least the server clock \
                 in microseconds ({} now){room}",
                self.max, self.data_type, self.clock_us
            ));
            fix.push("NO MAXVALUE".to_owned());
        }
        if self.cycle {
            problems.push("CYCLE: past its maximum it starts again from its minimum".to_owned());
            fix.push("NO CYCLE".to_owned());
        }
        // The value the next `nextval` starts from.
        let position = self.last_value.unwrap_or(self.start);
        let ahead = position.saturating_sub(self.clock_us);
        if ahead > DAY_US {
            problems.push(format!(
                "it stands at {position}, {} days ahead of the server clock in microseconds \
                 ({} now): its tokens come from the sequence alone, and should it ever be lost \
                 (dropped and recreated, set back, restored from an older copy, a failover to \
                 an asynchronous replica) the clock floor could not keep the next tokens above \
                 the ones it handed out. Restart it below the clock; fences that accepted its \
                 tokens refuse every newer holder until they are reset with it",
                ahead / DAY_US,
                self.clock_us
            ));
        }
        if self.cache > 1 {
            problems.push(format!(
                "CACHE {}: each session hands out numbers from a block of {} of its own, \
                 so tokens drawn on different sessions interleave instead of rising",
                self.cache, self.cache
            ));
            fix.push("CACHE 1".to_owned());
        }
        if ahead > DAY_US {
            // The start too: a later plain `RESTART` goes back to it.
            fix.push("START WITH 1 RESTART".to_owned());
        }
        if problems.is_empty() {
            return Ok(());
        }
        Err(Failure::msg(format!(
            "the token sequence {s}.dlock_token_seq cannot give rising fencing tokens: {}; \
             have its owner fix it with: ALTER SEQUENCE {s}.dlock_token_seq {};",
            problems.join("; "),
            fix.join(" "),
            s = quoted_schema,
        )))
    }
}

/// What became of the lock when its statement failed, for the messages
/// below: given back, for every lease, and for a transaction lock, whose
/// savepoint is rolled back.
pub(super) const NOT_TAKEN: &str = "the lock was not taken";

/// The draw lock, as the messages of a statement that waited for a lock
/// name it among what it may have waited for (see `draw_lock!`).
pub(super) const DRAW_LOCK: &str = "its draw lock (the advisory lock (0x64726177, the sequence's \
     oid), held by a draw that waits, or taken by hand)";

/// What to say when a lock statement refused the sequence (see
/// `draw_token!`): a DBA changed it while services run, so the check at
/// session open did not see it.
pub(super) fn refusal(unfit: super::sql::Unfit, quoted_schema: &str) -> String {
    match unfit {
        super::sql::Unfit::Settings => format!(
            "the token sequence {s}.dlock_token_seq was changed so that it cannot give rising \
             fencing tokens (CACHE above 1: sessions hand out numbers from blocks of their own, \
             so tokens interleave; CYCLE; or an INCREMENT that is not positive), and {NOT_TAKEN}; \
             have its owner fix it with: ALTER SEQUENCE {s}.dlock_token_seq INCREMENT BY 1 NO \
             CYCLE CACHE 1;",
            s = quoted_schema
        ),
        super::sql::Unfit::AheadOfClock => format!(
            "the token sequence {s}.dlock_token_seq stands more than a day ahead of the server \
             clock in microseconds (set ahead, or the server clock stepped back), so its tokens \
             rest on the sequence alone and would go back should it ever be lost; {NOT_TAKEN}. \
             Restart it below the clock: ALTER SEQUENCE {s}.dlock_token_seq START \
             WITH 1 RESTART; (and reset the fences that accepted its tokens with it), or set \
             the server clock right",
            s = quoted_schema
        ),
    }
}

/// What to say when a lock statement failed on the token sequence for a
/// reason its draw does not check for: its maximum reached (a DBA lowered
/// `MAXVALUE` while services run: `nextval` refuses to pass it, `setval`
/// to set it), or a privilege on it or its schema revoked. `None` for any
/// other error, or for one a DBA's trigger raised (its code is the
/// trigger's to choose). The server's own text follows as the cause.
pub(super) fn failure(err: &tokio_postgres::Error, quoted_schema: &str) -> Option<String> {
    use tokio_postgres::error::SqlState;
    if super::sql::raised_by_a_trigger(err) {
        return None;
    }
    let code = err.code()?;
    // `setval`'s refusal names the sequence, in the server's language.
    let out_of_bounds = *code == SqlState::NUMERIC_VALUE_OUT_OF_RANGE
        && err
            .as_db_error()
            .is_some_and(|db| db.message().contains("dlock_token_seq"));
    if *code == SqlState::SEQUENCE_GENERATOR_LIMIT_EXCEEDED || out_of_bounds {
        return Some(format!(
            "the token sequence {s}.dlock_token_seq reached its MAXVALUE, so no token above the \
             ones handed out can be drawn, and {NOT_TAKEN}; have its owner raise it with: ALTER \
             SEQUENCE {s}.dlock_token_seq NO MAXVALUE",
            s = quoted_schema
        ));
    }
    (*code == SqlState::INSUFFICIENT_PRIVILEGE).then(|| {
        format!(
            "the role may not draw tokens: it needs USAGE on the schema {s} and USAGE and \
             UPDATE on the sequence {s}.dlock_token_seq (see docs/postgres.md); {NOT_TAKEN}",
            s = quoted_schema
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW_US: i64 = 1_800_000_000_000_000;

    fn created_by_dlock() -> Settings {
        Settings {
            increment: 1,
            cache: 1,
            cycle: false,
            max: i64::MAX,
            data_type: "bigint".to_owned(),
            clock_us: NOW_US,
            last_value: Some(NOW_US),
            start: 1,
        }
    }

    fn refusal(settings: Settings) -> String {
        settings
            .check("\"dlock\"")
            .expect_err("refused")
            .to_string()
    }

    #[test]
    fn the_sequence_dlock_creates_passes() {
        assert!(created_by_dlock().check("\"dlock\"").is_ok());
        let larger_steps = Settings {
            increment: 7,
            ..created_by_dlock()
        };
        assert!(larger_steps.check("\"dlock\"").is_ok());
    }

    #[test]
    fn each_unfit_setting_is_named_with_its_fix() {
        let cached = refusal(Settings {
            cache: 20,
            ..created_by_dlock()
        });
        assert!(cached.contains("CACHE 20"), "{cached}");
        assert!(
            cached.ends_with("ALTER SEQUENCE \"dlock\".dlock_token_seq CACHE 1;"),
            "{cached}"
        );
        let cycling = refusal(Settings {
            cycle: true,
            ..created_by_dlock()
        });
        assert!(cycling.ends_with("dlock_token_seq NO CYCLE;"), "{cycling}");
        let falling = refusal(Settings {
            increment: -1,
            max: -1,
            ..created_by_dlock()
        });
        assert!(
            falling.ends_with("dlock_token_seq INCREMENT BY 1 NO MAXVALUE;"),
            "{falling}"
        );
        let integer = refusal(Settings {
            max: i64::from(i32::MAX),
            data_type: "integer".to_owned(),
            ..created_by_dlock()
        });
        assert!(
            integer.contains("MAXVALUE 2147483647 (AS integer)"),
            "{integer}"
        );
        assert!(
            integer.ends_with("dlock_token_seq AS bigint NO MAXVALUE;"),
            "{integer}"
        );
        let short = refusal(Settings {
            max: NOW_US + 1_000_000,
            ..created_by_dlock()
        });
        assert!(short.contains("less than a century"), "{short}");
    }

    #[test]
    fn several_problems_get_one_statement_that_fixes_them_all() {
        let text = refusal(Settings {
            increment: -5,
            cache: 3,
            cycle: true,
            max: -1,
            data_type: "smallint".to_owned(),
            clock_us: NOW_US,
            last_value: None,
            start: 1,
        });
        assert!(
            text.ends_with(
                "ALTER SEQUENCE \"dlock\".dlock_token_seq \
                 AS bigint INCREMENT BY 1 NO MAXVALUE NO CYCLE CACHE 1;"
            ),
            "{text}"
        );
    }

    #[test]
    fn a_sequence_more_than_a_day_ahead_of_the_clock_is_refused_with_a_restart_below_it() {
        let never_drawn = refusal(Settings {
            last_value: None,
            start: 4_000_000_000_000_000_000,
            ..created_by_dlock()
        });
        assert!(
            never_drawn.contains("stands at 4000000000000000000"),
            "{never_drawn}"
        );
        assert!(
            never_drawn.contains("clock floor could not"),
            "{never_drawn}"
        );
        assert!(
            never_drawn.ends_with("ALTER SEQUENCE \"dlock\".dlock_token_seq START WITH 1 RESTART;"),
            "{never_drawn}"
        );
        let set_ahead = refusal(Settings {
            last_value: Some(NOW_US + 2 * DAY_US),
            ..created_by_dlock()
        });
        assert!(set_ahead.contains("2 days ahead"), "{set_ahead}");
        // Within a day: a burst ahead of the clock, or a clock set right.
        for last in [NOW_US + 1_000, NOW_US + DAY_US, NOW_US - 5 * DAY_US] {
            let near = Settings {
                last_value: Some(last),
                ..created_by_dlock()
            };
            assert!(near.check("\"dlock\"").is_ok(), "{last}");
        }
        // Not drawn yet: the start counts, not a last value set before.
        let restarted = Settings {
            last_value: None,
            start: 1,
            ..created_by_dlock()
        };
        assert!(restarted.check("\"dlock\"").is_ok());
    }
}
