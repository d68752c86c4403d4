"""The application: what `hf-taskmoe train` and `examples/run_multitask.py` run (`train`), and what it calls --
the family settings as options (`family_options`), the command line's presets and switches (`command_line`), task
data, checkpoint and tokenizer loading with one-paragraph refusals (`loading`), the output folder's checks, lock and
replacement (`run_folder`), baselines, results and the run summary (`reporting`), secrets and the Hub upload
(`push`), exit statuses (`errors`); `console`: the `hf-taskmoe` command. The library (`hf_taskmoe.training`) never
imports it."""
