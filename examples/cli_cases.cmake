# Command-line cases of bad input (included by examples/CMakeLists.txt): specdec_cli_case(NAME
# EXIT_STATUS REGEX COMMAND...). Each bad flag or value exits with status 2 and a message naming
# the flag and the value; nothing runs before the command line is known to be good.
set(G $<TARGET_FILE:specdec-generate>)
set(D $<TARGET_FILE:specdec-demo>)
set(_bundled "${PROJECT_SOURCE_DIR}/models/bundled")
string(REPEAT "x" 600 _long_prompt)  # the bundled target's context is 512

# Empty prompts in every mode that takes one.
foreach(_mode speculative autoregressive ngram prompt-lookup suffix stand beam)
  specdec_cli_case(empty_prompt_${_mode} 2 "--prompt must not be empty" ${G} --mode ${_mode} --prompt @EMPTY@)
endforeach()

# Strict numbers: the whole text, of the right type, in range.
specdec_cli_case(gamma_not_a_number 2 "--gamma: 'abc' is not an integer in \\[1, 1024\\]" ${G} --gamma abc)
specdec_cli_case(gamma_trailing_text 2 "--gamma: '12abc' is not an integer" ${G} --gamma 12abc)
specdec_cli_case(gamma_fraction 2 "--gamma: '1.9' is not an integer" ${G} --gamma 1.9)
specdec_cli_case(gamma_zero 2 "--gamma: 0 is outside \\[1, 1024\\]" ${G} --gamma 0)
specdec_cli_case(gamma_huge 2 "--gamma: 9223372036854775807 is outside" ${G} --gamma-policy schedule
  --gamma 9223372036854775807)
specdec_cli_case(max_new_tokens_exponent 2 "--max-new-tokens: '1e6' is not an integer" ${G} --max-new-tokens 1e6)
specdec_cli_case(max_new_tokens_huge 2 "--max-new-tokens: 9223372036854775807 is outside" ${G}
  --max-new-tokens 9223372036854775807)
specdec_cli_case(seed_negative 2 "--seed: '-1' is not an integer" ${G} --seed -1)
specdec_cli_case(top_p_above_one 2 "--top-p: 1.5 is outside \\(0, 1\\]" ${G} --temperature 1 --top-p 1.5)
specdec_cli_case(top_p_nan 2 "--top-p: 'nan' is not a finite number" ${G} --temperature 1 --top-p nan)
specdec_cli_case(top_k_negative 2 "--top-k: -5 is outside" ${G} --temperature 1 --top-k -5)
specdec_cli_case(thresholds_empty_item 2 "--thresholds: '' in '0.1,,0.2' is not a number" ${G} --calibrate
  --thresholds 0.1,,0.2)
specdec_cli_case(medusa_head_not_a_folder 2 "--drafter .*README.md: not a folder" ${G} --mode medusa
  --drafter "${PROJECT_SOURCE_DIR}/README.md")
specdec_cli_case(parallel_drafter_not_a_folder 2 "--drafter .*README.md: not a folder \\(--mode parallel reads a parallel drafter's folder\\)"
  ${G} --mode parallel --drafter "${PROJECT_SOURCE_DIR}/README.md")
specdec_cli_case(parallel_drafter_without_mask 2 "config.json: missing key 'pard_token'" ${G} --mode parallel
  --drafter "${_bundled}/drafter")
specdec_cli_case(tree_dynamic_in_parallel 2 "--tree dynamic does not apply to --mode parallel: a parallel drafter fills static trees" ${G}
  --mode parallel --tree dynamic)
specdec_cli_case(eagle_head_of_another_target 2 "config.json: hidden_size = 192 but the target's hidden size is 96" ${G}
  --mode eagle --target "${_bundled}/drafter")
specdec_cli_case(num_beams_bound 2 "--num-beams: 1000 is outside \\[1, 64\\]" ${G} --mode beam --num-beams 1000)
specdec_cli_case(unknown_flag 2 "--frobnicate" ${G} --frobnicate)
specdec_cli_case(missing_value 2 "--gamma" ${G} --gamma)
specdec_cli_case(bad_mode 2 "--mode: .*sideways" ${G} --mode sideways)

# Flags that do not apply to the chosen mode are errors, not silently ignored.
specdec_cli_case(storage_in_speculative 2 "--storage applies to --mode ngram, stand or suffix, not --mode speculative"
  ${G} --storage "${PROJECT_SOURCE_DIR}/README.md")
specdec_cli_case(save_storage_in_autoregressive 2 "--save-storage applies to --mode ngram, stand or suffix" ${G}
  --mode autoregressive --save-storage x.bin)
specdec_cli_case(ngram_order_with_storage 2 "--ngram-order does not apply with --storage" ${G} --mode ngram
  --storage "${PROJECT_SOURCE_DIR}/README.md" --ngram-order 4)
specdec_cli_case(draft_min_share_above_one 2 "--draft-min-share: 1.5 is outside \\[0, 1\\]" ${G} --mode ngram
  --draft-min-share 1.5)
specdec_cli_case(draft_rule_in_speculative 2 "--draft-min-share applies to --mode ngram" ${G} --draft-min-share 0.9)
specdec_cli_case(suffix_factor_negative 2 "--suffix-factor: -1 is outside \\[0, 1024\\]" ${G} --mode suffix
  --suffix-factor -1)
specdec_cli_case(suffix_depth_too_small 2 "--suffix-depth: 1 is outside \\[2, 1024\\]" ${G} --mode suffix
  --suffix-depth 1)
specdec_cli_case(suffix_depth_in_ngram 2 "--suffix-depth applies to --mode suffix, not --mode ngram" ${G} --mode ngram
  --suffix-depth 8)
specdec_cli_case(suffix_tree_in_batch 2 "--suffix-tree does not apply to --batch-file" ${G} --mode suffix
  --suffix-tree --batch-file "${PROJECT_SOURCE_DIR}/README.md")
specdec_cli_case(tree_static_in_eagle 2 "--tree static does not apply to --mode eagle" ${G} --mode eagle --tree static)
specdec_cli_case(tree_dynamic_in_medusa 2 "--tree dynamic does not apply to --mode medusa" ${G} --mode medusa
  --tree dynamic)
specdec_cli_case(tree_in_ngram 2 "--tree applies to --mode speculative, eagle, medusa or parallel, not --mode ngram" ${G}
  --mode ngram --tree dynamic)
specdec_cli_case(tree_depth_without_tree 2 "--tree-depth applies with --tree static or dynamic" ${G} --tree-depth 3)
specdec_cli_case(tree_nodes_without_tree 2 "--tree-nodes applies to --mode stand, or with --tree" ${G} --tree-nodes 8)
specdec_cli_case(tree_top_k_static 2 "--tree-top-k applies to --tree dynamic" ${G} --tree static --tree-top-k 2)
specdec_cli_case(tree_score_temperature_static 2 "--tree-score-temperature applies to --tree dynamic" ${G}
  --tree static --tree-score-temperature 0.5)
specdec_cli_case(tree_score_temperature_without_tree 2 "--tree-score-temperature applies with --tree static or dynamic"
  ${G} --tree-score-temperature 0.5)
specdec_cli_case(tree_score_temperature_zero 2 "--tree-score-temperature: 0 is outside \\(0, 1e\\+06\\]" ${G}
  --tree dynamic --tree-score-temperature 0)
specdec_cli_case(tree_unknown 2 "--tree: wide not in" ${G} --tree wide)
specdec_cli_case(tree_with_batch 2 "--batch-file does not apply with --tree" ${G} --tree dynamic
  --batch-file "${PROJECT_SOURCE_DIR}/README.md")
specdec_cli_case(tree_with_gamma_policy 2 "--gamma-policy does not apply with --tree" ${G} --tree static
  --gamma-policy egag)
specdec_cli_case(trace_in_beam 2 "--trace applies to" ${G} --mode beam --trace)
specdec_cli_case(compare_in_beam 2 "--compare applies to" ${G} --mode beam --compare)
specdec_cli_case(temperature_in_beam 2 "--temperature applies to" ${G} --mode beam --temperature 0.5)
foreach(_mode autoregressive beam stand)
  specdec_cli_case(gamma_in_${_mode} 2 "--gamma applies to --mode speculative, ngram, prompt-lookup, suffix, eagle, medusa or parallel" ${G}
    --mode ${_mode} --gamma 3)
endforeach()
specdec_cli_case(top_p_without_temperature 2 "--top-k and --top-p apply when sampling" ${G} --top-p 0.9)
specdec_cli_case(egag_beta_with_fixed 2 "apply to --gamma-policy egag or schedule" ${G} --egag-beta 0.5)

# Temperatures too small for the logits: the message blames the temperature, not the model.
specdec_cli_case(tiny_temperature 2 "the target's logits are finite but its distribution contains NaN.*temperature is too small"
  ${G} --mode autoregressive --temperature 1e-300 --max-new-tokens 4)

# Files: the wrong kind of path is named as such.
specdec_cli_case(dev_file_folder 2 "--dev-file /tmp: not a regular file" ${G} --calibrate --dev-file /tmp)
specdec_cli_case(save_storage_folder 2 "--save-storage /tmp is a folder" ${G} --mode ngram --save-storage /tmp)
# A FIFO or a device node in the file's place is refused before generating (a save would replace it).
execute_process(COMMAND mkfifo "${CMAKE_CURRENT_BINARY_DIR}/save_fifo" ERROR_QUIET)
specdec_cli_case(save_storage_fifo 2 "--save-storage .*/save_fifo is a FIFO, not a regular file" ${G} --mode ngram
  --save-storage "${CMAKE_CURRENT_BINARY_DIR}/save_fifo")
specdec_cli_case(save_storage_device 2 "--save-storage /dev/null is a character device, not a regular file" ${G}
  --mode stand --save-storage /dev/null)
specdec_cli_case(target_config_file 2 "config.json: is a file of a Hugging Face checkpoint: pass the folder" ${G}
  --target "${_bundled}/target/config.json")
specdec_cli_case(target_safetensors_file 2 "model.safetensors: is a file of a Hugging Face checkpoint" ${G}
  --target "${_bundled}/target/model.safetensors")
specdec_cli_case(max_seq_len_limit 2 "max_position_embeddings = [0-9]+ exceeds the limit of 16 \\(LoadLimits::max_sequence_length\\)"
  ${G} --max-seq-len 16)
specdec_cli_case(prompt_longer_than_context 2 "--prompt of [0-9]+ bytes is at least [0-9]+ tokens, more than the target's max_sequence_length"
  ${G} --mode autoregressive --prompt "${_long_prompt}")

# The demo's command line.
specdec_cli_case(demo_gamma_text 2 "--gamma: '4x' is not an integer" ${D} --gamma 4x)
specdec_cli_case(demo_unknown_flag 2 "--nope" ${D} --nope)
specdec_cli_case(threads_zero 2 "--threads: 0 is outside \\[1, 1024\\]" ${G} --threads 0)
specdec_cli_case(threads_word 2 "--threads: 'many' is neither auto nor an integer" ${G} --threads many)

# Tokenizers: --chat needs a chat format; a tokenizer.json must be one and fit the model.
specdec_cli_case(chat_without_format 2 "--chat needs a tokenizer.json" ${G} --chat)
specdec_cli_case(tokenizer_json_not_a_tokenizer 2 "hf_tokenizer_fixtures.json: model must be an object" ${G}
  --tokenizer "${PROJECT_SOURCE_DIR}/tests/data/hf_tokenizer_fixtures.json")
specdec_cli_case(tokenizer_folder_without_file 2 "tokenizer.json: no such file" ${G}
  --tokenizer "${PROJECT_SOURCE_DIR}/tests")

# Remote verification: the flags that go with --verifier, and a server that is not there.
if(SPECDEC_HAVE_REMOTE)
  specdec_cli_case(verifier_mode 2 "--verifier applies to --mode speculative or autoregressive, not --mode ngram"
    ${G} --verifier 127.0.0.1:1 --mode ngram)
  specdec_cli_case(verifier_compare 2 "--compare does not apply to --verifier: the target is on the server"
    ${G} --verifier 127.0.0.1:1 --compare)
  specdec_cli_case(verifier_without_port 2 "--verifier must be HOST:PORT, got localhost" ${G} --verifier localhost)
  specdec_cli_case(latency_without_verifier 2 "apply to --verifier" ${G} --added-latency-ms 5)
  specdec_cli_case(verifier_unreachable 1 "Open failed \\(UNAVAILABLE\\)" ${G} --verifier 127.0.0.1:1)
  set(V $<TARGET_FILE:specdec-verifier>)
  specdec_cli_case(verifier_public_without_token 2 "is not loopback: a token or TLS with client certificates"
    ${V} --address 0.0.0.0:0)
  # Token files: one reader on both sides (remote/token.hpp). A byte gRPC metadata cannot carry is
  # refused with the file's name, never passed to gRPC (which aborts); "tok\r\n" reads as "tok".
  file(WRITE "${CMAKE_CURRENT_BINARY_DIR}/token_tab" "to\tk\n")
  file(WRITE "${CMAKE_CURRENT_BINARY_DIR}/token_crlf" "tok\r\n")
  specdec_cli_case(verifier_token_tab 2 "--verifier-token-file .*token_tab: the token holds byte 0x09 at position 2"
    ${G} --verifier 127.0.0.1:1 --verifier-token-file "${CMAKE_CURRENT_BINARY_DIR}/token_tab")
  specdec_cli_case(verifier_token_crlf 1 "Open failed \\(UNAVAILABLE\\)"
    ${G} --verifier 127.0.0.1:1 --verifier-token-file "${CMAKE_CURRENT_BINARY_DIR}/token_crlf")
  specdec_cli_case(verifier_token_folder 2 "--verifier-token-file .* is a folder"
    ${G} --verifier 127.0.0.1:1 --verifier-token-file "${CMAKE_CURRENT_BINARY_DIR}")
  specdec_cli_case(server_token_tab 2 "--token-file .*token_tab: the token holds byte 0x09 at position 2"
    ${V} --token-file "${CMAKE_CURRENT_BINARY_DIR}/token_tab")
  specdec_cli_case(verifier_bad_gamma 2 "--max-gamma: -1 is outside" ${V} --max-gamma -1)
  specdec_cli_case(verifier_bad_batch 2 "--max-batch: 0 is outside" ${V} --max-batch 0)
  # TLS: unreadable and non-PEM files, a certificate without its key, TLS without client
  # certificates off loopback, and the client's TLS flags.
  set(TLS "${PROJECT_SOURCE_DIR}/tests/data/tls")
  specdec_cli_case(verifier_tls_missing_file 2 "--tls-cert /nonexistent/server.pem does not exist"
    ${V} --tls-cert /nonexistent/server.pem)
  specdec_cli_case(verifier_tls_cert_folder 2 "--tls-cert .*/data/tls is a folder" ${V} --tls-cert "${TLS}")
  specdec_cli_case(verifier_tls_not_pem 2 "holds no PEM block"
    ${V} --tls-client-ca "${PROJECT_SOURCE_DIR}/tests/data/byte_tokenizer/tokenizer.json")
  specdec_cli_case(verifier_tls_without_key 2 "needs both certificate_chain and private_key"
    ${V} --tls-cert "${TLS}/server.pem")
  specdec_cli_case(verifier_public_tls_without_client_ca 2 "is not loopback: a token or TLS with client certificates"
    ${V} --address 0.0.0.0:0 --tls-cert "${TLS}/server.pem" --tls-key "${TLS}/server.key")
  specdec_cli_case(tls_without_verifier 2 "apply to --verifier" ${G} --verifier-tls-ca "${TLS}/ca.pem")
  specdec_cli_case(verifier_tls_key_alone 2 "a client certificate needs both certificate_chain and private_key"
    ${G} --verifier 127.0.0.1:1 --verifier-tls-ca "${TLS}/ca.pem" --verifier-tls-key "${TLS}/client.key")
  specdec_cli_case(verifier_tls_key_of_another 2
    "--tls-key .*/client.key is not the private key of the certificate in --tls-cert .*/server.pem"
    ${V} --tls-cert "${TLS}/server.pem" --tls-key "${TLS}/client.key")
  # Operator files that are FIFOs without a writer (which would block an open for ever) are
  # refused at once, naming the flag; each case must end within 10 s (its CTest timeout).
  set(_fifo "${CMAKE_CURRENT_BINARY_DIR}/fifo")
  if(NOT EXISTS "${_fifo}")
    execute_process(COMMAND mkfifo "${_fifo}")
  endif()
  foreach(_case IN ITEMS "token-file;token" "tls-cert;cert" "tls-key;key" "tls-client-ca;client_ca")
    list(GET _case 0 _flag)
    list(GET _case 1 _name)
    specdec_cli_case(verifier_fifo_${_name} 2 "--${_flag} .*/fifo is a FIFO \\(named pipe\\)" ${V} --${_flag} "${_fifo}")
    set_tests_properties(cli.verifier_fifo_${_name} PROPERTIES TIMEOUT 10)
  endforeach()
  specdec_cli_case(verifier_token_fifo 2 "--verifier-token-file .*/fifo is a FIFO"
    ${G} --verifier 127.0.0.1:1 --verifier-token-file "${_fifo}")
  set_tests_properties(cli.verifier_token_fifo PROPERTIES TIMEOUT 10)
endif()

# Tensor parallelism: the group's shape, and a model that does not divide over it, named before
# any rank starts (the bundled target's 3 key/value heads do not split over 2 ranks).
specdec_cli_case(tp_world_size_zero 2 "--world-size: 0 is outside \\[1, 1024\\]" ${G} --rank 0 --world-size 0
  --master 127.0.0.1:29511)
specdec_cli_case(tp_rank_alone 2 "--rank applies to a group started by hand" ${G} --rank 1)
specdec_cli_case(tp_and_master 2 "--tp starts its ranks on this machine" ${G} --tp 2 --master 127.0.0.1:29511)
specdec_cli_case(tp_rank_too_large 2 "--rank 2 must be below --world-size 2" ${G} --rank 2 --world-size 2
  --master 127.0.0.1:29511)
specdec_cli_case(tp_bad_master 2 "Rendezvous::master must be host:port with a port in \\[1, 65535\\], got \"nowhere\"" ${G}
  --rank 0 --world-size 2 --master nowhere)
specdec_cli_case(tp_does_not_divide 2 "LlamaConfig::n_kv_heads \\(3\\) does not divide by the world size \\(2\\)" ${G}
  --tp 2 --mode autoregressive)
specdec_cli_case(tp_with_verifier 2 "do not apply to --verifier" ${G} --tp 2 --verifier 127.0.0.1:29511)
if(DEFINED _stories)  # a target that divides over 2 ranks (see examples/CMakeLists.txt)
  specdec_cli_case(tp_unreachable_master 2 "rank 1 of 2 could not meet the others at master 127.0.0.1:9 within 1500 ms"
    ${G} ${_stories} --mode autoregressive --rank 1 --world-size 2 --master 127.0.0.1:9 --tp-timeout-ms 1500)
endif()
if(SPECDEC_HAVE_REMOTE)  # specdec-verifier takes the same flags
  specdec_cli_case(verifier_tp_does_not_divide 2 "LlamaConfig::n_kv_heads \\(3\\) does not divide by the world size \\(2\\)"
    ${V} --tp 2)
  specdec_cli_case(verifier_tp_rank_alone 2 "--rank applies to a group started by hand" ${V} --rank 1)
  specdec_cli_case(verifier_tp_and_master 2 "--tp starts its ranks on this machine" ${V} --tp 2 --master 127.0.0.1:29511)
  if(DEFINED _stories)
    specdec_cli_case(verifier_tp_unreachable_master 2
      "specdec-verifier \\(rank 1\\): tensor parallelism: rank 1 of 2 could not meet the others at master 127.0.0.1:9"
      ${V} --target "${_models}/stories260K/stories260K.bin" --rank 1 --world-size 2 --master 127.0.0.1:9
      --tp-timeout-ms 1500)
  endif()
endif()

# --weights: the formats it knows, the CPU only, and not for batches (whose ragged rows would
# unpack every weight in every forward).
specdec_cli_case(weights_unknown 2 "--weights: fp8 not in" ${G} --weights fp8)
specdec_cli_case(weights_int8_on_cuda 2 "--weights int8 applies to --device cpu, not cuda" ${G} --weights int8
  --device cuda)
specdec_cli_case(weights_int8_float16 2 "--weights int8 packs float32 or bfloat16 weights, not --dtype float16"
  ${G} --weights int8 --dtype float16)
specdec_cli_case(weights_packed_float16 2 "--weights packed packs float32 or bfloat16 weights, not --dtype float16"
  ${G} --weights packed --dtype float16)
specdec_cli_case(weights_packed_batch 2 "--weights packed does not apply to --batch-file" ${G} --weights packed
  --batch-file "${PROJECT_SOURCE_DIR}/examples/batch_prompts.txt")
