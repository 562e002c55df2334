// signsgd: being written (issue 3)
